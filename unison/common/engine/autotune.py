"""Autotune: pick the fusion threshold and cycle time from measured throughput.

With ``UNISON_AUTOTUNE=1`` the engine runs trials: each candidate setting is
kept for a sample of at least ``UNISON_AUTOTUNE_STEPS_PER_SAMPLE`` cycles and
``SAMPLE_BYTES`` reduced (after ``UNISON_AUTOTUNE_WARMUP_SAMPLES`` discarded
ones), and scored by bytes per second. Trial boundaries depend only on counters
that are identical on every rank (cycles, bytes executed), so all ranks reach
them in the same cycle; rank 0 then scores the trial and broadcasts the next
setting, so every rank always uses the same values. The search is
coordinate-wise: fusion thresholds at the default cycle time, then cycle times
at the best threshold; the best setting found is kept for the rest of the job.
Each trial is a row of ``UNISON_AUTOTUNE_LOG`` (CSV, written by rank 0).
"""

from __future__ import annotations

import csv
import logging
import os
import time
from typing import Any

from unison.common.config import Config

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
        self.candidates = [(mb << 20, config.cycle_time) for mb in THRESHOLDS_MB]
        self.phase = "threshold"
        self.index = -config.autotune_warmup_samples
        self.steps = config.autotune_steps_per_sample
        self.scores: dict[tuple[int, float], float] = {}
        self.done = False
        self._start: tuple[float, int, int] | None = None
        self.trials = 0
        #: (cycle, fusion threshold, cycle time ms) at every change: identical on every rank
        self.history: list[tuple[int, int, float]] = []
        if rank == 0 and self.log_path:
            self._write_row(["trial", "fusion_threshold_bytes", "cycle_time_ms", "bytes", "seconds",
                             "bytes_per_s", "phase"], mode="w")

    def _write_row(self, row: list[Any], mode: str = "a") -> None:
        tmp = self.log_path + ".tmp"
        rows: list[list[str]] = []
        if mode == "a" and os.path.exists(self.log_path):
            with open(self.log_path, newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
        rows.append([str(v) for v in row])
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(rows)
        os.replace(tmp, self.log_path)

    def step(self, st: Any) -> tuple[int, float] | None:
        """Called once per cycle on every rank; returns new (threshold, cycle ms) or None."""
        change = self._step(st)
        if change is not None:
            self.history.append((st.controller.cycles, int(change[0]), float(change[1])))
        return change

    def _step(self, st: Any) -> tuple[int, float] | None:
        if self.done:
            return None
        ctl, ex = st.controller, st.executor
        now = time.monotonic()
        if self._start is None:
            self._start = (now, ctl.cycles, ex.bytes_done)
            return self._enter()
        t0, c0, b0 = self._start
        if ctl.cycles - c0 < self.steps or ex.bytes_done - b0 < SAMPLE_BYTES:
            return None
        rate = (ex.bytes_done - b0) / max(now - t0, 1e-9)
        best = st.comm.bcast(self._score(rate, ex.bytes_done - b0, now - t0) if self.rank == 0 else None,
                             root=0)
        self._start = (time.monotonic(), ctl.cycles, ex.bytes_done)
        return self._advance(best)

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
        if self.phase == "threshold" and best is not None:
            self.phase = "cycle_time"
            self.candidates = [(best[0], ms) for ms in CYCLE_TIMES_MS if ms != best[1]] + [best]
            self.index = 0
            return self._enter()
        self.done = True
        if best is not None:
            self.current = best
            if self.rank == 0:
                logger.info("[unison rank 0] autotune settled on fusion threshold %d bytes, cycle time "
                            "%g ms", best[0], best[1])
        return self.current
