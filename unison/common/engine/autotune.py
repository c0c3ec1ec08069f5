"""Autotune: pick the fusion threshold and cycle time from measured throughput.

With ``UNISON_AUTOTUNE=1`` the engine runs trials: each candidate setting is
kept for a sample of at least ``UNISON_AUTOTUNE_STEPS_PER_SAMPLE`` cycles and
``SAMPLE_BYTES`` executed (after ``UNISON_AUTOTUNE_WARMUP_SAMPLES`` discarded
ones), and scored by bytes per second. Trial boundaries depend only on counters
that are identical on every rank: the global set's cycle count and the executors'
``agreed_bytes`` (executor [Note: agreed bytes]) summed over the process sets of every
rank (the global set, and any registered set of all ranks: a job that reduces through
one tuned nothing before 2026-12-05), never on bytes only this rank received (an
uneven alltoall or reducescatter) or a smaller set's, so all ranks reach them in the same
cycle and enter the decision's broadcast together; rank 0 scores the trial and
broadcasts the next setting, so every rank always uses the same values. The search
is coordinate-wise: fusion thresholds at the default cycle time, then cycle times
at the best threshold; the best setting found is kept for the rest of the job. A
setting given explicitly is not tuned ([Note: autotune keeps what was set]). The
first candidate is applied only once bytes flow (before that, with no warm-up sample,
it was applied at the first cycle and kept for good when none came: fusion off).
Each trial is a row of ``UNISON_AUTOTUNE_LOG`` (CSV, written by rank 0 into a file
it creates afresh: see :func:`~unison.common.engine.timeline.open_fresh`).
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import time
from typing import IO, Any

import numpy as np

from unison.common.config import Config, autotune_fixed
from unison.common.engine.controller import wait
from unison.common.engine.timeline import open_fresh

__all__ = ["Autotuner"]

logger = logging.getLogger(__name__)

THRESHOLDS_MB = (0, 1, 4, 16, 64, 128)
CYCLE_TIMES_MS = (0.25, 0.5, 1.0, 2.0, 5.0)
#: A sample also needs this many bytes reduced, so that idle cycles do not count as samples.
SAMPLE_BYTES = 1 << 20


class Autotuner:
    """Online coordinate search over (fusion threshold bytes, cycle time ms)."""

    def __init__(self, config: Config, rank: int) -> None:
        self.rank = rank
        self.log_path = config.autotune_log
        self.current = (config.fusion_threshold, config.cycle_time)
        #: the values set explicitly (an init() argument or a variable), kept as set: Horovod's rule
        #: ([Note: autotune keeps what was set]); every rank's list is the same (checked at init())
        self.fixed = autotune_fixed(config)
        self.candidates = [(mb << 20, config.cycle_time) for mb in THRESHOLDS_MB]
        self.phase = "threshold"
        if "fusion_threshold" in self.fixed:
            self.phase, self.candidates = "cycle_time", self._cycle_candidates(self.current)
        self.index = -config.autotune_warmup_samples
        self.steps = config.autotune_steps_per_sample
        self.scores: dict[tuple[int, float], float] = {}
        self.done = False
        self._start: tuple[float, int, int] | None = None
        self.trials = 0
        #: (cycle, fusion threshold, cycle time ms) at every change: identical on every rank
        self.history: list[tuple[int, int, float]] = []
        self._log: IO[str] | None = None
        if len(self.fixed) == 2:  # nothing left to tune
            self.done = True
            if rank == 0:
                logger.warning("UNISON_AUTOTUNE is on, but the fusion threshold and the cycle time are both "
                               "set (%s, %s): autotune keeps set values as they are, so it tunes nothing",
                               config.sources.get("fusion_threshold"), config.sources.get("cycle_time"))
            return
        if rank == 0 and self.log_path:
            self._open_log()

    @staticmethod
    def _cycle_candidates(best: tuple[int, float]) -> list[tuple[int, float]]:
        """The cycle-time phase's trials at ``best``'s threshold, ``best`` itself last."""
        return [(best[0], ms) for ms in CYCLE_TIMES_MS if ms != best[1]] + [best]

    def _open_log(self) -> None:
        """Rank 0 writes the CSV header into a fresh file and keeps it open to append rows."""
        self._log, tmp = open_fresh(self.log_path)
        self._writer = csv.writer(self._log)
        try:
            self._write_row(["trial", "fusion_threshold_bytes", "cycle_time_ms", "bytes", "seconds",
                             "bytes_per_s", "phase"])
            os.replace(tmp, self.log_path)
        except BaseException:  # (no hidden temporary file left behind, no log written into it)
            log, self._log = self._log, None
            with contextlib.suppress(OSError):  # (a full disk fails the close's flush as well)
                log.close()
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def _write_row(self, row: list[Any]) -> None:
        if self._log is not None:
            self._writer.writerow(row)
            self._log.flush()

    def close(self) -> None:
        """Close the CSV log (the engine calls this when it stops)."""
        if self._log is not None:
            self._log.close()
            self._log = None

    def step(self, st: Any, agreed_bytes: int) -> tuple[int, float] | None:
        """Called once per cycle on every rank, with the global set's state ``st`` and the bytes reduced
        so far as every rank counts them alike; returns new (threshold, cycle ms) or None."""
        change = self._step(st, agreed_bytes)
        if change is not None:
            self.history.append((st.controller.cycles, int(change[0]), float(change[1])))
        return change

    def _step(self, st: Any, agreed: int) -> tuple[int, float] | None:
        if self.done:
            return None
        ctl = st.controller
        now = time.monotonic()
        if self._start is None:
            if not agreed:  # nothing reduced yet (alike on every rank): keep the configured values
                return None
            self._start = (now, ctl.cycles, agreed)
            return self._enter()
        t0, c0, b0 = self._start
        nbytes = agreed - b0
        if ctl.cycles - c0 < self.steps or nbytes < SAMPLE_BYTES:  # alike on every rank
            return None
        best = self._agree(st, self._score(nbytes / max(now - t0, 1e-9), nbytes, now - t0)
                           if self.rank == 0 else None)
        self._start = (time.monotonic(), ctl.cycles, agreed)
        return self._advance(best)

    @staticmethod
    def _agree(st: Any, best: tuple[int, float] | None) -> tuple[int, float] | None:
        """Rank 0's decision on every rank: a broadcast of three numbers (no pickle)."""
        buf = np.array([best is not None, *(best or (0, 0.0))], dtype=np.float64)
        wait(st.comm.Ibcast(buf, root=0))
        return (int(buf[1]), float(buf[2])) if buf[0] else None

    def _score(self, rate: float, nbytes: int, seconds: float) -> tuple[int, float] | None:
        self.trials += 1
        if self.index >= 0:
            self.scores[self.current] = rate
            if self.log_path:
                self._write_row([self.trials, self.current[0], self.current[1], nbytes, f"{seconds:.6f}",
                                 f"{rate:.1f}", self.phase])
        if self.index + 1 < len(self.candidates):
            return None
        return max(self.scores, key=self.scores.get)  # type: ignore[arg-type]

    def _enter(self) -> tuple[int, float] | None:
        if self.index < 0:
            return None
        self.current = self.candidates[self.index]
        return self.current

    def _advance(self, best: tuple[int, float] | None) -> tuple[int, float] | None:
        self.index += 1
        if self.index < len(self.candidates):
            return self._enter()
        if self.phase == "threshold" and best is not None and "cycle_time" not in self.fixed:
            self.phase = "cycle_time"
            self.candidates = self._cycle_candidates(best)
            self.index = 0
            return self._enter()
        self.done = True
        self.close()
        if best is not None:
            self.current = best
            if self.rank == 0:
                logger.info("[unison rank 0] autotune settled on fusion threshold %d bytes, cycle time "
                            "%g ms", best[0], best[1])
        return self.current
