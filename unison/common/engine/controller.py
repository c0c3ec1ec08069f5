"""Negotiation: which named requests are ready on every rank of a process set.

Each engine cycle runs one small all-reduce per process set and, only when some
rank has something new to say, one all-gather::

    cycle:  vec = [ready bits of cached names ... | flags]      (uint64 words)
            Allreduce(vec, BAND)                                 -> ready everywhere
            if any rank set ANNOUNCE:
                Allgatherv(JSON records (name, dim0, signature) of new requests)
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

[Note: wire records] What ranks send each other is plain data: announcements are
JSON (:func:`encode_announcement`), the stall round JSON too, everything else
numeric arrays. A peer's bytes are parsed and checked, never unpickled, so they
cannot run code on this rank. Pickle is left to the explicit object API
(:mod:`unison.common.engine.objects`), where the user asks for it.

[Note: join] A joined rank contributes the op's identity to allreduces and passes
barriers; it has no data for the other collectives, nor can it run an engine
action (``add_process_set``, ``remove_process_set``). Those complete with a
:class:`JoinError` on the ranks that submitted them and are remembered on the
joined ranks, whose ``join()`` still returns normally once every rank has joined
(Horovod's contract) but logs a warning naming each refused collective and the
ranks that submitted it. Every rank sets
``FLAG_JOINED`` while joined, so the cache path sees it in the very cycle that a
rank joins; the announcement of that cycle names the joined ranks.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from unison.common.engine.errors import REFUSALS, StallError, winning_kind
from unison.common.engine.requests import ACTION, Kind, Request, Signature, describe, describe_member

__all__ = ["Controller", "Response", "FLAG_ANNOUNCE", "FLAG_SHUTDOWN", "FLAG_STALL_CHECK",
           "FLAG_STALL_ABORT", "FLAG_TIMELINE", "FLAG_JOINED", "encode_announcement",
           "decode_announcement", "allgather_bytes", "works_with_join"]

logger = logging.getLogger(__name__)

FLAG_ANNOUNCE = 1 << 0
FLAG_SHUTDOWN = 1 << 1
FLAG_STALL_CHECK = 1 << 2
FLAG_STALL_ABORT = 1 << 3
FLAG_TIMELINE = 1 << 4
FLAG_JOINED = 1 << 5
#: this rank has nothing pending on the set (and has not joined): see [Note: a peer with nothing to offer]
FLAG_IDLE = 1 << 6
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
    #: why every rank fails it, other than a mismatch (""): the kind that wins among the ranks' refusals
    #: ("T", "U" or "V": [Note: refusal kinds] in errors.py), or "join" ([Note: join])
    invalid: str = ""
    #: payload size, computed once by the executor
    nbytes: int = -1
    #: ranks that submitted it, when negotiated in full (None for a cached name)
    submitters: list[int] | None = None


# ----------------------------------------------------------------- wire records
#: one announced request: [name, dim0, kind, dtype, shape, op, root, prescale, postscale,
#: error, algorithm, layout]; the fields after dim0 are :class:`Signature`'s, in its order
_RECORD_LEN = 2 + len(Signature._fields)
_FIELD_TYPES = {"kind": int, "dtype": int, "op": int, "root": int, "prescale": float,
                "postscale": float, "error": str, "algorithm": str}


def encode_announcement(entries: list[tuple[str, Signature, int]], joined: bool) -> bytes:
    """This rank's announcement: ``[joined, [record, ...]]`` as UTF-8 JSON (see [Note: wire records])."""
    records = [[name, dim0, *sig] for name, sig, dim0 in entries]
    return json.dumps([joined, records], separators=(",", ":")).encode()


def decode_announcement(raw: bytes, rank: int) -> tuple[list[tuple[str, Signature, int]], bool]:
    """Parse and check rank ``rank``'s announcement; returns ``(entries, joined)``.

    Raises:
        ValueError: the bytes are not a well-formed announcement (a different Unison
            version on that rank, or corrupted traffic).
    """
    try:
        joined, records = json.loads(raw)
        if type(joined) is not bool or type(records) is not list:
            raise ValueError("expected [joined, records]")
        return [_decode_record(rec) for rec in records], joined
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed negotiation record from rank {rank} ({exc}; {bytes(raw[:60])!r}...): "
                         "every rank must run the same Unison version") from None


def _decode_record(rec: Any) -> tuple[str, Signature, int]:
    if type(rec) is not list or len(rec) != _RECORD_LEN:
        raise ValueError(f"a record must be a list of {_RECORD_LEN} fields")
    name, dim0, *fields = rec
    values = dict(zip(Signature._fields, fields, strict=True))
    shape = values["shape"]
    if type(name) is not str or type(dim0) is not int or type(shape) is not list \
            or not all(type(d) is int for d in shape):
        raise ValueError("bad name, dim0 or shape")
    for key, typ in _FIELD_TYPES.items():
        if typ is float and type(values[key]) is int:
            values[key] = float(values[key])
        if type(values[key]) is not typ:
            raise ValueError(f"field {key} must be {typ.__name__}")
    error = values["error"]
    if error and (error[:1] not in REFUSALS or error[1:2] != ":"):
        raise ValueError(f"field error must be empty or a refusal kind ({'/'.join(REFUSALS)}), ':' and a message")
    values["shape"] = tuple(shape)
    values["layout"] = _decode_layout(values["layout"])
    return name, Signature(**values), dim0


def _decode_layout(raw: Any) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A grouped request's ``[[dtype code, [dim, ...]], ...]`` as the tuples its Signature holds."""
    if type(raw) is not list:
        raise ValueError("field layout must be a list")
    out = []
    for member in raw:
        if type(member) is not list or len(member) != 2 or type(member[0]) is not int \
                or type(member[1]) is not list or not all(type(d) is int for d in member[1]):
            raise ValueError("a layout member must be [dtype code, [dims]]")
        out.append((member[0], tuple(member[1])))
    return tuple(out)


def allgather_bytes(comm: Any, mpi: Any, payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order (two non-blocking collectives, waited on gently)."""
    mine = np.frombuffer(payload, dtype=np.uint8)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    wait(comm.Iallgather(np.array([mine.size], dtype=np.int64), sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait(comm.Iallgatherv(mine, [gathered, sizes, offsets, mpi.BYTE]))
    return [gathered[o:o + n].tobytes() for o, n in zip(offsets.tolist(), sizes.tolist(), strict=True)]


def works_with_join(sig: Signature) -> bool:
    """Whether a collective can run while some ranks have joined (see [Note: join])."""
    return sig.kind == Kind.ALLREDUCE or (sig.kind == Kind.BARRIER and sig.algorithm != ACTION)


def kind_name(sig: Signature) -> str:
    """The collective's name for messages ("broadcast", or "process set change" for an engine action)."""
    return "add_process_set/remove_process_set" if sig.algorithm == ACTION else Kind(sig.kind).name.lower()


def join_error(name: str, sig: Signature, joined: list[int]) -> str:
    what = kind_name(sig)
    return (f"{what} {name!r} ran while rank(s) {sorted(joined)} had joined: a joined rank has no data "
            "for it, so only allreduce and barrier work with join (Horovod refuses the others too). "
            "Run it before join() on every rank, or after every rank's join() returned")


def wait(req: Any, check: Callable[[], None] | None = None) -> None:
    """Complete a non-blocking MPI request, spinning briefly, then sleeping with backoff.

    A rank waiting for slower peers thus costs almost no CPU, which matters when
    the waiting thread shares cores with the training computation. ``check``, if
    given, runs before each sleep and may raise to stop waiting (the request is
    then still pending: the caller owns it).
    """
    for _ in range(200):
        if req.Test():
            return
    delay = 2e-5
    while not req.Test():
        if check is not None:
            check()
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


class Controller:
    """The negotiation state of one process set on this rank."""

    def __init__(self, comm: Any, mpi: Any, capacity: int, set_id: int = 0,
                 job_ranks: Sequence[int] | None = None) -> None:
        self.comm, self.mpi, self.set_id = comm, mpi, set_id
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        #: the job rank of each of this set's ranks, for messages (None: the job's own set). Errors named a
        #: rank's position in the set (on [1, 2], "rank 0" for job rank 1) before 2026-12-05
        self.job_ranks = None if job_ranks is None else list(job_ranks)
        self.capacity = capacity
        #: the cycle's buffers (see :meth:`_buffers`) and the shape they were made for
        self._bufs: tuple[np.ndarray, np.ndarray, memoryview] = (np.zeros(0, np.uint64),) * 2 + (memoryview(b""),)
        self._bufs_key: tuple[int, bool] | None = None
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
        #: timeline mode: bit -> {rank: first time seen set}
        self.bit_seen: dict[int, dict[int, float]] = {}
        #: names the stall inspector failed elsewhere before this rank submitted them -> message
        self.stalled_names: dict[str, str] = {}
        #: collectives refused while this rank was joined, with their submitters: its join() warns
        #: of them (see [Note: join])
        self.refused_while_joined: list[str] = []
        #: when this rank last took a request into this set's negotiation (the deadlock check's "quiet")
        self.last_add = time.monotonic()

    # ------------------------------------------------------------- requests
    def add(self, req: Request) -> bool:
        """Take ``req`` into negotiation; False when it failed at once (see :meth:`mark_stalled`)."""
        if self.stalled_names and req.name in self.stalled_names:
            req.handle.set_error(StallError(self.stalled_names.pop(req.name)))
            return False
        self.pending[req.name] = req
        self.last_add = max(self.last_add, req.submitted)  # (a held unnamed request comes later, older)
        if self.cache_sig.get(req.name) != req.signature():
            self.to_announce.append(req.name)
        return True

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
            waiting = set(self.to_announce) if self.to_announce else ()
            cache_bit = self.cache_bit
            for name in self.pending:
                bit = cache_bit.get(name)
                if bit is not None and name not in waiting:
                    bits |= 1 << bit
        flags = local_flags
        if self.joined:
            flags |= FLAG_JOINED
            if not self._join_told:
                flags |= FLAG_ANNOUNCE
        elif not self.pending and not self.table:
            flags |= FLAG_IDLE
        if self.to_announce:
            flags |= FLAG_ANNOUNCE
        last_word = (~flags & _ANY_MASK) | (ALL_JOINED if self.joined else 0)
        timeline = self.timeline_mode
        vec, out, vec_bytes = self._buffers(words, timeline)
        # the row as one little-endian integer: the bit words, then the flags word
        vec_bytes[:] = (bits | last_word << (64 * words)).to_bytes(vec.nbytes, "little")
        if timeline:
            wait(self.comm.Iallgather(vec, out))
            anded = int.from_bytes(np.bitwise_and.reduce(out, axis=0).tobytes(), "little")
            self._note_ready_times(out[:, :words])
        else:
            wait(self.comm.Iallreduce(vec, out, op=self.mpi.BAND))
            anded = int.from_bytes(out.data.cast("B"), "little")
        last = anded >> (64 * words)
        any_flags = ~last & _ANY_MASK
        all_joined = bool(last & ALL_JOINED)
        responses: list[Response] = []
        ready = 0 if all_joined else anded & ((1 << (64 * words)) - 1)
        pending, names, sigs = self.pending, self.bit_names, self.cache_sig
        while ready:
            low = ready & -ready
            ready ^= low
            b = low.bit_length() - 1
            name = names[b]
            if name is not None:
                times = self.bit_seen.pop(b, None)
                if not timeline:  # recorded while an earlier timeline ran: not this one's
                    times = None
                responses.append(Response(name, sigs[name], pending.pop(name, None), ready_times=times))
                self.cache_bit[name] = self.cache_bit.pop(name)  # most recently used
        if any_flags & FLAG_ANNOUNCE:
            responses += self._announce_round()
        if any_flags & FLAG_JOINED:
            self._refuse_with_join(responses)
        # every rank gathers the ready times from the next cycle on while rank 0's timeline records
        # (agreed through this cycle's flags, so every rank picks the same collective next time)
        self.timeline_mode = bool(any_flags & FLAG_TIMELINE)
        if not self.timeline_mode:
            self.bit_seen.clear()  # ready times of a timeline that stopped: a later one must not show them
        return responses, any_flags, all_joined

    def _buffers(self, words: int, timeline: bool) -> tuple[np.ndarray, np.ndarray, memoryview]:
        """This cycle's row, what its collective fills (the BAND of every row, or every row in a
        timeline's cycles) and the row's bytes; kept while their shape stays, since each cycle's
        collective completes within it (an allocation and two conversions less per cycle)."""
        key = (words, timeline)
        if self._bufs_key != key:
            vec = np.zeros(words + 1, dtype=np.uint64)
            out = np.zeros((self.size, vec.size) if timeline else vec.size, dtype=np.uint64)
            self._bufs, self._bufs_key = (vec, out, vec.data.cast("B")), key
        return self._bufs

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
        self.to_announce.clear()
        self._join_told = self._join_told or tell_join
        gathered = allgather_bytes(self.comm, self.mpi, encode_announcement(entries, tell_join))
        now = time.monotonic()
        for r, raw in enumerate(gathered):
            their_entries, joined = decode_announcement(raw, r)
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
            ranks = sorted(entry)
            ref = entry[ranks[0]][0]
            error, invalid = self._check(name, entry, ranks)
            if error is None and self.capacity and (not joined or works_with_join(ref)):
                self._cache(name, ref)
            out.append(Response(name, ref, self.pending.pop(name, None), error, times, invalid,
                                submitters=ranks))
        return out

    def _check(self, name: str, entry: dict[int, tuple[Signature, int]],
               ranks: list[int]) -> tuple[str | None, str]:
        """(error text or None, the winning refusal kind or "") for every rank's submission of ``name``."""
        bad = [r for r in ranks if entry[r][0].error]
        if bad:  # error texts are "<kind>:<message>" ([Note: refusal kinds] in errors.py)
            invalid = winning_kind(entry[r][0].error[0] for r in bad)
            return (f"collective {name!r} failed on {len(bad)} of {self.size} rank(s): "
                    + "; ".join(f"rank {self.job(r)}: {entry[r][0].error[2:]}" for r in bad)), invalid
        ref = entry[ranks[0]][0]
        if any(entry[r][0] != ref for r in ranks) and all(entry[r][0].layout for r in ranks) \
                and len({entry[r][0]._replace(layout=(), shape=(), dtype=0) for r in ranks}) == 1:
            return self._layout_error(name, entry, ranks), ""  # only the members differ: name the first
        if any(entry[r][0] != ref for r in ranks):
            per_rank = "; ".join(f"rank {self.job(r)}: {describe(*entry[r])}" for r in ranks)
            return (f"tensor {name!r} was submitted with different arguments on different ranks: "
                    f"{per_rank}. Every rank must submit a name with the same collective, dtype, "
                    "shape (first dimension excepted for allgather/alltoall), op, root and "
                    "scale factors."), ""
        return None, ""

    def _layout_error(self, name: str, entry: dict[int, tuple[Signature, int]], ranks: list[int]) -> str:
        """The message for a grouped all-reduce whose members differ across ranks: the first one that does."""
        layouts = [entry[r][0].layout for r in ranks]
        longest = max(len(lay) for lay in layouts)
        i = next(i for i in range(longest) if len({lay[i] if i < len(lay) else None for lay in layouts}) > 1)
        per_rank = "; ".join(f"rank {self.job(r)}: {describe_member(lay[i] if i < len(lay) else None)}"
                             for r, lay in zip(ranks, layouts, strict=True))
        counts = sorted({len(lay) for lay in layouts})
        sizes = "" if len(counts) == 1 else f" (the group holds {' or '.join(map(str, counts))} tensors)"
        return (f"tensor {name + '.' + str(i)!r} of grouped_allreduce {name!r} was submitted with different "
                f"arguments on different ranks{sizes}: {per_rank}. Every rank must submit the same tensors, "
                "in the same order, with the same shapes and dtypes.")

    def _refuse_with_join(self, responses: list[Response]) -> None:
        """Fail what a joined rank cannot take part in, on every rank (see [Note: join])."""
        for resp in responses:
            if resp.error is None and not works_with_join(resp.sig):
                resp.error, resp.invalid = join_error(resp.name, resp.sig,
                                                      [self.job(r) for r in self.joined_ranks]), "join"
                if self.joined:
                    self.refused_while_joined.append(
                        f"{kind_name(resp.sig)} {resp.name!r} submitted by rank(s) "
                        f"{[self.job(r) for r in self._submitters(resp)]}")

    def job(self, rank: int) -> int:
        """``rank`` of this set as a rank of the job."""
        return rank if self.job_ranks is None else self.job_ranks[rank]

    def _submitters(self, resp: Response) -> list[int]:
        """Ranks (of this set) that submitted ``resp``: announced ones per the table, cached ones
        by every rank that had not joined (a joined rank sets every cached bit)."""
        if resp.submitters is not None:
            return resp.submitters
        joined = set(self.joined_ranks)
        return [r for r in range(self.size) if r not in joined]

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

    def finish_join(self) -> tuple[int, list[str]]:
        """All ranks joined: reset join state; return the last rank to join and what was refused
        while this rank had joined (see [Note: join])."""
        last = self.joined_ranks[-1] if self.joined_ranks else self.size - 1
        refused, self.refused_while_joined = self.refused_while_joined, []
        self.joined, self._join_told, self.joined_ranks = False, False, []
        return last, refused

    # ---------------------------------------------------------------- stalls
    def mark_stalled(self, names: dict[str, str]) -> None:
        """Fail this rank's next submission of each name with its message (the stall inspector
        failed it on the ranks that had submitted it)."""
        self.stalled_names.update(names)

    def fail_all(self, error: BaseException) -> None:
        """Fail every pending handle and forget what was announced."""
        for req in self.pending.values():
            req.handle.set_error(error)
        self.pending.clear()
        self.to_announce.clear()
        self.table.clear()
        self.seen_at.clear()
        self.bit_seen.clear()
