"""Engine pieces that need no MPI: the negotiation wire records and the files the engine writes."""

from __future__ import annotations

import csv
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from unison.common.config import Config
from unison.common.engine import controller, handles
from unison.common.engine.autotune import Autotuner
from unison.common.engine.errors import ShutdownError
from unison.common.engine.handles import Handle
from unison.common.engine.requests import Kind, Request, Signature
from unison.common.engine.timeline import Timeline


def _request(name: str, kind: Kind, array: np.ndarray, **fields) -> Request:
    return Request(name, kind, array, Handle(name), **fields)


def test_signature_is_a_named_record():
    sig = _request("x", Kind.ALLGATHER, np.ones((3, 2), np.float32)).signature()
    assert isinstance(sig, Signature)
    assert (sig.kind, sig.shape, sig.op, sig.root, sig.error, sig.algorithm) == (
        Kind.ALLGATHER, (2,), -1, -1, "", "")  # (the job's algorithm setting: set by Engine.submit)
    bad = _request("y", Kind.BROADCAST, np.ones(2), error="V:root_rank=9 is out of range").signature()
    assert bad.error.startswith("V:") and bad.dtype == -1


def test_announcement_round_trips_as_plain_data():
    entries = [
        ("grad/ü.0", _request("a", Kind.ALLREDUCE, np.ones((4, 5)), op=1, prescale=0.1,
                                postscale=1 / 3).signature(), 4),
        ("bc", _request("b", Kind.BROADCAST, np.ones(()), root=1).signature(), 0),
        ("err", _request("c", Kind.ALLTOALL, np.ones(1), error="T:bad dtype").signature(), 1),
    ]
    raw = controller.encode_announcement(entries, joined=True)
    json.loads(raw)  # plain JSON, nothing executable
    back, joined = controller.decode_announcement(raw, rank=3)
    assert joined is True and back == entries
    assert all(isinstance(sig, Signature) and isinstance(sig.shape, tuple) for _, sig, _ in back)


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creating the file proves the payload ran


def test_a_pickled_announcement_is_refused_not_run(tmp_path):
    marker = tmp_path / "payload-ran"
    raw = pickle.dumps(([("x", _Exploit(str(marker)), 0)], False))
    with pytest.raises(ValueError, match="rank 1"):
        controller.decode_announcement(raw, rank=1)
    assert not marker.exists()


@pytest.mark.parametrize("raw", [b'[true, [["a", 1]]]', b'{"a": 1}', b'[1, []]',
                                 b'[false, [["a", 0, 1, 7, "x", -1, -1, 1.0, 1.0, "", "auto"]]]'])
def test_a_malformed_announcement_names_the_rank(raw):
    with pytest.raises(ValueError, match="from rank 2"):
        controller.decode_announcement(raw, rank=2)


def test_timeline_does_not_follow_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    path = tmp_path / "timeline.json"
    os.symlink(victim, str(path) + ".tmp")
    tl = Timeline()
    tl.start(str(path))
    tl.begin("t", "ALLREDUCE")
    tl.end("t", "ALLREDUCE")
    tl.stop()
    assert victim.read_text() == "keep"
    assert {e["name"] for e in json.loads(path.read_text())} >= {"ALLREDUCE", "thread_name"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.json", "timeline.json.tmp", "victim.txt"]


@pytest.mark.parametrize("planted", ["tune.csv.tmp", "tune.csv"])
def test_autotune_log_never_writes_through_a_planted_symlink(tmp_path, planted):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / planted)
    log = tmp_path / "tune.csv"
    tuner = Autotuner(Config(autotune=True, autotune_log=str(log)), rank=0)
    tuner.index = 0  # past the warm-up: each scored sample is a row
    for rate in (1e6, 2e6):
        tuner._score(rate, 1 << 20, 0.5)
    tuner.close()
    assert victim.read_text() == "keep"
    assert not log.is_symlink()
    rows = list(csv.DictReader(log.open()))
    assert [float(r["bytes_per_s"]) for r in rows] == [1e6, 2e6]


class _GoneEngine:
    def alive(self) -> bool:
        return False

    def exit_error(self) -> BaseException:
        return ShutdownError("the engine thread has ended")


def test_wait_raises_when_its_engine_thread_is_gone(monkeypatch):
    monkeypatch.setattr(handles, "LIVENESS_S", 0.05)
    handle = Handle("orphan")
    handle._engine = _GoneEngine()  # as Engine.submit records it
    with pytest.raises(ShutdownError, match="has ended"):
        handle.wait(timeout=5)


def test_timeline_streams_to_its_path_and_stop_ends_open_slices(tmp_path, monkeypatch):
    """Before 2026-12-05: the trace was renamed into place only at stop() (a job that died left a hidden
    temporary file), a relative path was resolved again at stop() (a chdir moved it, or stop() raised),
    and slices open at stop() stayed open while an end for a slice begun before start() was written."""
    monkeypatch.chdir(tmp_path)
    tl = Timeline()
    tl.end("before", "ALLREDUCE")  # inactive: nothing
    tl.start("tl.json")
    tl.begin("t", "NEGOTIATE_ALLREDUCE")
    tl.flush()
    during = (tmp_path / "tl.json").read_text()  # at the path while recording, a whole JSON array
    assert {e["name"] for e in json.loads(during)} >= {"NEGOTIATE_ALLREDUCE", "thread_name"}
    tl.end("u", "QUEUE")  # never begun in this file: no end event
    tl.begin("t", "ALLREDUCE")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    tl.stop()
    events = json.loads((tmp_path / "tl.json").read_text())
    assert [(e["name"], e["ph"]) for e in events if e["ph"] in "BE"] == [
        ("NEGOTIATE_ALLREDUCE", "B"), ("ALLREDUCE", "B"), ("ALLREDUCE", "E"), ("NEGOTIATE_ALLREDUCE", "E")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "tl.json"]
    assert not list((tmp_path / "elsewhere").iterdir())


KILLED_WHILE_RECORDING = """
import os, signal, sys
from unison.common.engine.timeline import Timeline
tl = Timeline()
tl.start(sys.argv[1])
for i in range(3000):  # past the 256 KiB buffer: written in pieces, and at every flush
    tl.begin(f"t.{i % 50}", "ALLREDUCE", args={"note": "\u00fc" * (i % 3)})
    if i % 7 == 0:
        tl.flush()
    if i % 2:
        tl.end(f"t.{i % 50}", "ALLREDUCE")
tl.flush()
tl.begin("last", "QUEUE")
tl.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_timeline_is_a_whole_json_array_after_every_flush_even_when_killed(tmp_path):
    """Before 2026-12-07 a trace whose writer was killed (rank 0, when another rank aborts the job: Open
    MPI kills it without running its Python) lacked the closing bracket: json.load failed on it."""
    path = tmp_path / "tl.json"
    proc = subprocess.run([sys.executable, "-c", KILLED_WHILE_RECORDING, str(path)], timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    events = json.loads(path.read_text())
    assert events[-1]["name"] == "QUEUE" and events[-1]["ph"] == "B"
    assert sum(e["name"] == "ALLREDUCE" for e in events) == 3000 + 1500
    assert os.path.getsize(path) > 1 << 18
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tl.json"]
    tl = Timeline()  # stop() closes it once: the bracket is the file's end, nothing after it
    tl.start(str(path))
    tl.begin("x", "ALLREDUCE")
    tl.flush()
    tl.stop()
    text = path.read_text()
    assert text.endswith("}\n]\n") and [e["ph"] for e in json.loads(text)].count("E") == 1


def test_timeline_abandon_marks_the_abort_and_closes_the_trace(tmp_path):
    tl = Timeline()
    tl.start(str(tmp_path / "tl.json"))
    tl.begin("grad", "ALLREDUCE")
    tl.abandon("the collective timeout")
    assert not tl.active
    events = json.loads((tmp_path / "tl.json").read_text())
    assert [e["name"] for e in events if e["ph"] == "i"] == ["job aborted: the collective timeout"]
    assert [e["ph"] for e in events if e["name"] == "ALLREDUCE"] == ["B", "E"]
    tl.abandon("again")  # closed: nothing more


def test_wait_all_timeout_bounds_the_whole_wait_not_each_member():
    """Members finishing one after another, each within the timeout of the one before: before 2026-12-07 the
    timeout applied to each member's wait in turn, and three of them took about three times it."""
    import threading
    import time

    from unison.common.engine.handles import wait_all

    handles = [Handle(f"member.{i}") for i in range(3)]
    timers = [threading.Timer(0.3 * (i + 1), h.set_result, (i,)) for i, h in enumerate(handles)]
    for timer in timers:
        timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            wait_all(handles, timeout=0.45)
        assert time.monotonic() - started < 0.8
        assert wait_all(handles, timeout=5.0) == [0, 1, 2]  # (and all of them, once done)
    finally:
        for timer in timers:
            timer.cancel()
