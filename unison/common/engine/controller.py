"""Negotiation: which named requests are ready on every rank of a process set.

Each engine cycle runs one small all-reduce per process set and, only when some
rank has something new to say, one all-gather::

    cycle:  vec = [ready bits of cached names ... | flags]      (uint64 words)
            Allreduce(vec, BAND)                                 -> ready everywhere
            if any rank set ANNOUNCE:
                Allgatherv(pickled (name, signature, dim0) of new requests)
                -> every rank updates the same table; names now submitted by all
                   ranks complete, in the same order on every rank, and join the cache

[Note: response cache] A name that completed once with signature S gets a bit
(the same bit on every rank, because the table that assigns it is identical on
every rank). Later submissions of that name with signature S only set the bit:
in steady state no names travel, only ``ceil(cached / 64) + 1`` words per
cycle. A submission with a different signature is announced in full; the
announcement evicts the cached entry everywhere, every rank waiting on that bit
re-announces, and the table then compares all ranks' signatures.

Flags share the last word: bits 0-31 are "any rank" flags, sent inverted so
that AND computes OR; bits 32-63 are "every rank" flags, sent plainly.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from unison.common.engine.requests import Request, Signature, describe

__all__ = ["Controller", "Response", "FLAG_ANNOUNCE", "FLAG_SHUTDOWN", "FLAG_STALL_CHECK",
           "FLAG_STALL_ABORT", "FLAG_TIMELINE"]

logger = logging.getLogger(__name__)

FLAG_ANNOUNCE = 1 << 0
FLAG_SHUTDOWN = 1 << 1
FLAG_STALL_CHECK = 1 << 2
FLAG_STALL_ABORT = 1 << 3
FLAG_TIMELINE = 1 << 4
ALL_JOINED = 1 << 32
_ANY_MASK = (1 << 32) - 1


@dataclass(slots=True)
class Response:
    """One name that every rank has submitted (or joined past): run it, or fail it."""

    name: str
    sig: Signature
    request: Request | None
    error: str | None = None
    ready_times: dict[int, float] | None = None
    #: "type" or "value": an invalid argument on some rank (TypeError / ValueError), not a mismatch
    invalid: str = ""
    #: payload size, computed once by the executor
    nbytes: int = -1


def wait(req: Any) -> None:
    """Complete a non-blocking MPI request, spinning briefly, then sleeping with backoff.

    A rank waiting for slower peers thus costs almost no CPU, which matters when
    the waiting thread shares cores with the training computation.
    """
    for _ in range(200):
        if req.Test():
            return
    delay = 2e-5
    while not req.Test():
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


class Controller:
    """The negotiation state of one process set on this rank."""

    def __init__(self, comm: Any, mpi: Any, capacity: int, set_id: int = 0) -> None:
        self.comm, self.mpi, self.set_id = comm, mpi, set_id
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.capacity = capacity
        self.pending: dict[str, Request] = {}
        self.to_announce: list[str] = []
        self.cache_bit: dict[str, int] = {}  # in least- to most-recently-used order
        self.cache_sig: dict[str, Signature] = {}
        self.bit_names: list[str | None] = []
        self.free_bits: list[int] = []
        #: name -> {rank: (signature, dim0)}; identical on every rank
        self.table: dict[str, dict[int, tuple[Signature, int]]] = {}
        self.seen_at: dict[str, dict[int, float]] = {}
        self.joined = False
        self._join_told = False
        self.joined_ranks: list[int] = []
        self.timeline_mode = False
        self.cycles = 0
        self.last_ready_bits = 0
        #: timeline mode: bit -> {rank: first time seen set}
        self.bit_seen: dict[int, dict[int, float]] = {}

    # ------------------------------------------------------------- requests
    def add(self, req: Request) -> None:
        self.pending[req.name] = req
        if self.cache_sig.get(req.name) != req.signature():
            self.to_announce.append(req.name)

    def has_work(self) -> bool:
        return bool(self.pending) or self.joined or bool(self.table)

    def join(self) -> None:
        self.joined, self._join_told = True, False

    # ---------------------------------------------------------------- cycle
    def cycle(self, local_flags: int) -> tuple[list[Response], int, bool]:
        """Run one negotiation round; returns (responses, any-rank flags, all joined)."""
        self.cycles += 1
        words = (len(self.bit_names) + 63) // 64
        bits = 0
        if self.joined:
            for b, name in enumerate(self.bit_names):
                if name is not None:
                    bits |= 1 << b
        else:
            waiting = set(self.to_announce)
            cache_bit = self.cache_bit
            for name in self.pending:
                bit = cache_bit.get(name)
                if bit is not None and name not in waiting:
                    bits |= 1 << bit
        vec = np.empty(words + 1, dtype=np.uint64)
        vec[:words] = np.frombuffer(bits.to_bytes(words * 8, "little"), dtype=np.uint64)
        flags = local_flags
        if self.to_announce or (self.joined and not self._join_told):
            flags |= FLAG_ANNOUNCE
        vec[words] = np.uint64((~flags & _ANY_MASK) | (ALL_JOINED if self.joined else 0))
        per_rank = None
        if self.timeline_mode:
            per_rank = np.empty((self.size, words + 1), dtype=np.uint64)
            wait(self.comm.Iallgather(vec, per_rank))
            result = np.bitwise_and.reduce(per_rank, axis=0)
        else:
            result = np.empty_like(vec)
            wait(self.comm.Iallreduce(vec, result, op=self.mpi.BAND))
        last = int(result[words])
        any_flags = ~last & _ANY_MASK
        all_joined = bool(last & ALL_JOINED)
        self.last_ready_bits = bits
        responses: list[Response] = []
        if per_rank is not None:
            self._note_ready_times(per_rank[:, :words])
        ready = 0 if all_joined else int.from_bytes(result[:words].tobytes(), "little")
        pending, names, sigs = self.pending, self.bit_names, self.cache_sig
        while ready:
            low = ready & -ready
            ready ^= low
            b = low.bit_length() - 1
            name = names[b]
            if name is not None:
                times = self.bit_seen.pop(b, None) if per_rank is not None else None
                responses.append(Response(name, sigs[name], pending.pop(name, None), ready_times=times))
                self.cache_bit[name] = self.cache_bit.pop(name)  # most recently used
        if any_flags & FLAG_ANNOUNCE:
            responses += self._announce_round()
        if any_flags & FLAG_TIMELINE:
            self.timeline_mode = not self.timeline_mode
        return responses, any_flags, all_joined

    def _note_ready_times(self, per_rank: np.ndarray) -> None:
        now = time.monotonic()
        for r in range(self.size):
            bits = int.from_bytes(per_rank[r].tobytes(), "little")
            while bits:
                low = bits & -bits
                bits ^= low
                self.bit_seen.setdefault(low.bit_length() - 1, {}).setdefault(r, now)

    def _announce_round(self) -> list[Response]:
        entries = []
        for name in self.to_announce:
            req = self.pending.get(name)
            if req is not None:
                entries.append((name, req.signature(), req.array.shape[0] if req.array.ndim else 0))
        tell_join = self.joined and not self._join_told
        payload = np.frombuffer(pickle.dumps((entries, tell_join)), dtype=np.uint8)
        self.to_announce.clear()
        self._join_told = self._join_told or tell_join
        sizes = np.empty(self.size, dtype=np.int64)
        wait(self.comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes))
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
        wait(self.comm.Iallgatherv(payload, [gathered, sizes, offsets, self.mpi.BYTE]))
        now = time.monotonic()
        for r in range(self.size):
            their_entries, joined = pickle.loads(gathered[offsets[r]:offsets[r] + sizes[r]].tobytes())
            if joined and r not in self.joined_ranks:
                self.joined_ranks.append(r)
            for name, sig, dim0 in their_entries:
                if name in self.cache_bit:
                    self._evict(name)
                self.table.setdefault(name, {})[r] = (sig, dim0)
                self.seen_at.setdefault(name, {})[r] = now
        return self._complete()

    def _evict(self, name: str) -> None:
        bit = self.cache_bit.pop(name)
        self.bit_names[bit] = None
        self.free_bits.append(bit)
        del self.cache_sig[name]
        if name in self.pending and name not in self.to_announce:
            self.to_announce.append(name)

    def _complete(self) -> list[Response]:
        joined = set(self.joined_ranks)
        out = []
        for name in list(self.table):
            entry = self.table[name]
            if not all(r in entry or r in joined for r in range(self.size)):
                continue
            del self.table[name]
            times = self.seen_at.pop(name, None)
            sigs = [entry[r][0] for r in sorted(entry)]
            ref = sigs[0]
            error = None
            bad = [r for r in sorted(entry) if entry[r][0][7]]
            invalid = ""
            if bad:  # error texts are "T:<message>" (TypeError) or "V:<message>" (ValueError)
                invalid = "type" if any(entry[r][0][7].startswith("T:") for r in bad) else "value"
                error = (f"collective {name!r} failed on {len(bad)} of {self.size} rank(s): "
                         + "; ".join(f"rank {r}: {entry[r][0][7][2:]}" for r in bad))
            elif any(s != ref for s in sigs):
                per_rank = "; ".join(f"rank {r}: {describe(entry[r][0], entry[r][1])}"
                                     for r in sorted(entry))
                error = (f"tensor {name!r} was submitted with different arguments on different ranks: "
                         f"{per_rank}. Every rank must submit a name with the same collective, dtype, "
                         "shape (first dimension excepted for allgather/alltoall), op, root and "
                         "scale factors.")
            elif self.capacity:
                self._cache(name, ref)
            out.append(Response(name, ref, self.pending.pop(name, None), error, times, invalid))
        return out

    def _cache(self, name: str, sig: Signature) -> None:
        """Give ``name`` a bit; when full, evict the least recently used name.

        Every rank sees the same completions in the same order, so every rank
        evicts the same name and reuses the same bit.
        """
        while len(self.cache_bit) >= self.capacity:
            self._evict(next(iter(self.cache_bit)))
        if self.free_bits:
            bit = self.free_bits.pop()
            self.bit_names[bit] = name
        else:
            bit = len(self.bit_names)
            self.bit_names.append(name)
        self.cache_bit[name] = bit
        self.cache_sig[name] = sig

    def finish_join(self) -> int:
        """All ranks joined: reset join state; return the last rank to join."""
        last = self.joined_ranks[-1] if self.joined_ranks else self.size - 1
        self.joined, self._join_told, self.joined_ranks = False, False, []
        return last

    # ---------------------------------------------------------------- stalls
    def stalled(self, older_than: float) -> list[tuple[str, list[int]]]:
        """(name, ranks that have not submitted it) for announced names waiting too long."""
        now = time.monotonic()
        joined = set(self.joined_ranks)
        out = []
        for name, entry in self.table.items():
            first = min(self.seen_at.get(name, {now: now}).values())
            if now - first >= older_than:
                missing = [r for r in range(self.size) if r not in entry and r not in joined]
                out.append((name, missing))
        return out

    def cached_stalls(self) -> list[tuple[str, list[int]]]:
        """Collective: every rank's ready bits, to name the ranks missing cached names."""
        words = (len(self.bit_names) + 63) // 64
        vec = np.frombuffer(self.last_ready_bits.to_bytes(words * 8, "little"), dtype=np.uint64).copy()
        gathered = np.empty((self.size, words), dtype=np.uint64)
        if words:
            wait(self.comm.Iallgather(vec, gathered))
        out = []
        for b, name in enumerate(self.bit_names):
            if name is None:
                continue
            has = [bool(int(gathered[r, b >> 6]) >> (b & 63) & 1) for r in range(self.size)]
            if any(has) and not all(has):
                out.append((name, [r for r in range(self.size) if not has[r]]))
        return out

    def fail_all(self, error: BaseException) -> None:
        """Fail every pending handle and forget what was announced."""
        for req in self.pending.values():
            req.handle.set_error(error)
        self.pending.clear()
        self.to_announce.clear()
        self.table.clear()
        self.seen_at.clear()
