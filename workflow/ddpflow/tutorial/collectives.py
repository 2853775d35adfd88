"""Collectives built from point-to-point messages only.

These are the tutorials' broadcast / reduce / all-reduce, written with nothing but
``dist.send``, ``dist.recv`` and ``dist.batch_isend_irecv`` (isend/irecv) so that the
algorithms and their costs are explicit. They are references for teaching and for
benchmarking against the real thing: in training use ``torch.distributed``'s own
collectives, which gloo/NCCL implement natively (and, on GPUs, over NVLink rings/trees).

Conventions shared by every function:

* ``tensor`` is modified in place (where the collective defines a result) and returned.
* ``src`` / ``dst`` are ranks *within* ``group`` (the default group when ``None``);
  they are translated to global ranks for the point-to-point calls. On the default
  group the two are the same, so calls read exactly like ``torch.distributed``'s.
* A process that is not a member of ``group`` returns its tensor untouched, as
  ``torch.distributed`` collectives do.
* Point-to-point calls need contiguous memory, so a non-contiguous tensor is staged
  through a contiguous copy and the result is copied back into the original view.
* ``op`` is ``"sum"``, ``"product"`` (or ``"prod"``), ``"max"`` or ``"min"``; a
  ``dist.ReduceOp`` of those names is accepted too.
* In the cost notes, ``n`` is the group size and ``B`` the tensor's size in bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _combiner(op: object) -> Combine:
    """Return ``f(acc, x)`` that folds ``x`` into ``acc`` in place for reduction ``op``."""
    # ReduceOp members carry a .name ("SUM", ...); plain strings are used as given.
    name = str(getattr(op, "name", op)).lower()
    if name == "sum":
        return lambda acc, x: acc.add_(x)
    if name in ("product", "prod"):
        return lambda acc, x: acc.mul_(x)
    if name == "max":
        return lambda acc, x: torch.maximum(acc, x, out=acc)
    if name == "min":
        return lambda acc, x: torch.minimum(acc, x, out=acc)
    raise ValueError(f"unsupported reduction op {op!r}; use sum, product, max or min")


def _membership(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank in group, group size); rank is -1 when this process is not a member."""
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Global rank of ``group_rank``: send/recv/P2POp address peers by global rank."""
    # get_global_rank() rejects None (it only recognises the WORLD object itself).
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _check_root(root: int, size: int, what: str) -> None:
    if not 0 <= root < size:
        raise ValueError(f"{what}={root} is not a rank of a group of size {size}")


def _staged(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when contiguous, else a contiguous copy to communicate through."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _unstage(tensor: torch.Tensor, work: torch.Tensor) -> None:
    """Copy the result back when it was computed in a staging copy."""
    if work is not tensor:
        tensor.copy_(work)


def _exchange(
    send_buf: torch.Tensor,
    dst: int,
    recv_buf: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Send to ``dst`` while receiving from ``src`` (global ranks), then wait for both.

    Posting both non-blocking ops before waiting is what keeps a ring from
    deadlocking: with blocking send() every rank would wait on a neighbour that is
    itself blocked in send(). Empty buffers are skipped on both sides alike (each
    rank derives the same chunk sizes), since some backends reject 0-byte messages.
    """
    ops = []
    if send_buf.numel():
        ops.append(dist.P2POp(dist.isend, send_buf, dst, group))
    if recv_buf.numel():
        ops.append(dist.P2POp(dist.irecv, recv_buf, src, group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Copy ``tensor`` from rank ``src`` to every rank of ``group`` over a binomial tree.

    Ranks are renumbered relative to the root (``rel = (rank - src) % n``). Rank
    ``rel`` receives from ``rel`` minus its lowest set bit, then forwards to
    ``rel + 2**k`` for each ``2**k`` below that bit, largest subtree first. The tree
    rather than a linear loop at the root: the root's ``n - 1`` sends are serial, so
    a linear broadcast takes ``n - 1`` message times, the tree ``ceil(log2 n)``,
    for the same total traffic.

    Messages: ``n - 1`` of ``B`` bytes in ``ceil(log2 n)`` rounds. Per rank: every
    non-root receives ``B``; a rank sends ``B`` per child, at most ``ceil(log2 n) * B``
    (the root). Bandwidth-wise this is still whole-tensor hops; the large-message
    optimum (scatter + all-gather, ~2B per rank) is not attempted here.
    """
    rank, size = _membership(group)
    if rank < 0:
        return tensor
    _check_root(src, size, "src")
    if size == 1 or tensor.numel() == 0:
        return tensor
    work = _staged(tensor)
    rel = (rank - src) % size
    mask = 1
    while mask < size:  # the lowest set bit of rel names the parent
        if rel & mask:
            dist.recv(work, _peer(group, (rank - mask) % size), group=group)
            break
        mask <<= 1
    mask >>= 1
    while mask:  # children sit at rel + each smaller power of two
        if rel + mask < size:
            dist.send(work, _peer(group, (rank + mask) % size), group=group)
        mask >>= 1
    _unstage(tensor, work)
    return tensor


def reduce(
    tensor: torch.Tensor, dst: int, op: object = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Combine every rank's ``tensor`` with ``op`` into ``tensor`` on rank ``dst``.

    The broadcast's binomial tree run backwards: at round ``k`` a rank whose
    relative rank has bit ``k`` set sends its partial result to ``rel - 2**k`` and
    is done; the others receive ``rel + 2**k``'s partial (if it exists) and fold it in.
    Only ``dst``'s tensor changes; intermediate ranks accumulate in a private copy so
    their input survives (``torch.distributed.reduce`` leaves it unspecified).

    Messages: ``n - 1`` of ``B`` bytes in ``ceil(log2 n)`` rounds. Per rank: every
    non-``dst`` rank sends ``B``; a rank receives ``B`` per child, at most
    ``ceil(log2 n) * B`` (``dst``). Extra memory: one ``B`` receive buffer, plus a
    ``B`` accumulator on intermediate ranks.
    """
    combine = _combiner(op)
    rank, size = _membership(group)
    if rank < 0:
        return tensor
    _check_root(dst, size, "dst")
    if size == 1 or tensor.numel() == 0:
        return tensor
    work = _staged(tensor)
    rel = (rank - dst) % size
    acc, incoming = work, None
    mask = 1
    while mask < size:
        if rel & mask:  # hand the partial result to the parent; this rank is done
            dist.send(acc, _peer(group, (rank - mask) % size), group=group)
            break
        if rel + mask < size:
            if incoming is None:
                incoming = torch.empty_like(work)
            if acc is tensor and rel != 0:  # don't clobber a non-root's input
                acc = work.clone()
            dist.recv(incoming, _peer(group, (rank + mask) % size), group=group)
            combine(acc, incoming)
        mask <<= 1
    if rel == 0:
        _unstage(tensor, work)
    return tensor


def naive_all_reduce(
    tensor: torch.Tensor, op: object = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce as ``reduce`` to rank 0 followed by ``broadcast`` from rank 0.

    Messages: ``2 (n - 1)`` of ``B`` bytes in ``2 ceil(log2 n)`` rounds. Per rank:
    at most ``ceil(log2 n) * B`` received and as much sent (rank 0), every rank at
    least ``B`` each way. Latency is good for small tensors, but each hop carries the
    whole tensor and rank 0 is the bottleneck, so bus bandwidth falls as ``n`` grows;
    compare ``ring_all_reduce``.
    """
    reduce(tensor, 0, op, group)
    broadcast(tensor, 0, group)
    return tensor


def ring_all_reduce(
    tensor: torch.Tensor, op: object = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Bandwidth-optimal ring all-reduce: reduce-scatter, then all-gather.

    The flattened tensor is cut into ``n`` chunks with ``torch.tensor_split`` (sizes
    differ by at most one element, so any ``numel`` works, including ``numel < n``).
    Reduce-scatter: in step ``s`` (``n - 1`` steps) rank ``r`` sends chunk ``r - s``
    to ``r + 1`` while receiving chunk ``r - s - 1`` from ``r - 1`` and folding it in;
    afterwards rank ``r`` holds the fully reduced chunk ``r + 1``. All-gather: ``n - 1``
    more steps pass the finished chunks around the ring, overwriting stale ones.

    Messages: ``2 (n - 1)`` per rank, each ``~B / n`` bytes, so every rank sends and
    receives ``2 (n - 1) / n * B`` -- independent of ``n`` for large ``n``, which is
    why nccl-tests' all-reduce busbw is ``algbw * 2 (n - 1) / n``. Latency is
    ``2 (n - 1)`` message times. Extra memory: one chunk-sized receive buffer.
    """
    combine = _combiner(op)
    rank, size = _membership(group)
    if rank < 0 or size == 1 or tensor.numel() == 0:
        return tensor
    work = _staged(tensor)
    chunks = torch.tensor_split(work.view(-1), size)  # views into work, no copies
    right, left = _peer(group, (rank + 1) % size), _peer(group, (rank - 1) % size)
    scratch = torch.empty_like(chunks[0])  # tensor_split makes the first chunk the largest
    for step in range(size - 1):
        mine = chunks[(rank - step - 1) % size]
        incoming = scratch[: mine.numel()]
        _exchange(chunks[(rank - step) % size], right, incoming, left, group)
        combine(mine, incoming)
    for step in range(size - 1):
        outgoing, stale = chunks[(rank + 1 - step) % size], chunks[(rank - step) % size]
        _exchange(outgoing, right, stale, left, group)
    _unstage(tensor, work)
    return tensor
