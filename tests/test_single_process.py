"""A plain process (no mpirun) is a job of size 1; settings and errors need no MPI job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import unison
from unison.common.config import load_config


@pytest.fixture
def fresh():
    unison.shutdown()
    yield
    unison.shutdown()


def test_collective_before_init_names_the_fix(fresh):
    with pytest.raises(unison.NotInitializedError, match=r"Call unison.init\(\) first"):
        unison.allreduce(np.ones(3))
    with pytest.raises(RuntimeError, match="unison.init"):
        unison.rank()


def test_size_one_semantics(fresh):
    unison.init()
    assert (unison.rank(), unison.size(), unison.local_rank(), unison.local_size()) == (0, 1, 0, 1)
    assert (unison.cross_rank(), unison.cross_size()) == (0, 1)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(unison.allreduce(x), x)
    np.testing.assert_array_equal(unison.allreduce(x, op=unison.Sum, prescale_factor=2.0,
                                                   postscale_factor=0.5), x)
    np.testing.assert_array_equal(unison.allgather(x), x)
    np.testing.assert_array_equal(unison.broadcast(x, root_rank=0), x)
    np.testing.assert_array_equal(unison.reducescatter(x, op=unison.Sum), x)
    out, splits = unison.alltoall(x)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(splits, [2])
    assert unison.broadcast(np.float64(3.0)).shape == ()
    unison.barrier()
    with pytest.raises(TypeError, match="complex128"):
        unison.allreduce(np.ones(2, complex))
    with pytest.raises(ValueError, match="root_rank=1"):
        unison.broadcast(x, root_rank=1)
    assert unison.allreduce(np.ones(3, np.int64) * 7).tolist() == [7, 7, 7]


def test_a_job_of_size_one_writes_its_timeline(fresh, tmp_path, monkeypatch):
    # no engine runs at size 1: start_timeline and UNISON_TIMELINE wrote nothing (Horovod writes one)
    unison.init()
    path = tmp_path / "tl.json"
    unison.start_timeline(str(path))
    unison.allreduce(np.ones(3), name="tl.a")
    unison.allgather(np.ones((2, 1)), name="tl.b")
    unison.stop_timeline()
    events = json.loads(path.read_text())
    rows = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert {"tl.a", "tl.b"} <= set(rows)
    phases = [(e["name"], e["ph"], e["tid"]) for e in events if e["ph"] in "BE"]
    assert phases == [("ALLREDUCE", "B", rows["tl.a"]), ("ALLREDUCE", "E", rows["tl.a"]),
                      ("ALLGATHER", "B", rows["tl.b"]), ("ALLGATHER", "E", rows["tl.b"])]
    unison.shutdown()
    env_path = tmp_path / "env.json"
    monkeypatch.setenv("UNISON_TIMELINE", str(env_path))
    unison.init()
    unison.broadcast(np.ones(2), 0, name="tl.c")
    unison.shutdown()
    events = json.loads(env_path.read_text())
    assert any(e["name"] == "BROADCAST" for e in events)


def test_init_is_idempotent_and_shutdown_allows_reinit(fresh):
    unison.init()
    unison.init()
    assert unison.is_initialized()
    unison.shutdown()
    assert not unison.is_initialized()
    unison.init()
    assert unison.size() == 1


def test_env_settings_and_horovod_alias():
    assert load_config({}).allreduce_algorithm == "auto"
    assert load_config({"UNISON_ALLREDUCE_ALGORITHM": "RING"}).allreduce_algorithm == "ring"
    assert load_config({"HOROVOD_ALLREDUCE_ALGORITHM": "rhd"}).allreduce_algorithm == "rhd"
    both = {"UNISON_ALLREDUCE_ALGORITHM": "mpi", "HOROVOD_ALLREDUCE_ALGORITHM": "rhd"}
    assert load_config(both).allreduce_algorithm == "mpi"
    assert load_config(both, allreduce_algorithm="ring").allreduce_algorithm == "ring"
    assert load_config({"UNISON_CHUNK_BYTES": "4096"}).chunk_bytes == 4096


@pytest.mark.parametrize("var, value, expected", [
    ("UNISON_ALLREDUCE_ALGORITHM", "fastest",
     "UNISON_ALLREDUCE_ALGORITHM=.fastest.*auto, ring, rhd, hierarchical, mpi"),
    ("HOROVOD_ALLREDUCE_ALGORITHM", "nccl",
     "HOROVOD_ALLREDUCE_ALGORITHM=.nccl.*auto, ring, rhd, hierarchical, mpi"),
    ("UNISON_BROADCAST_ALGORITHM", "ring", "UNISON_BROADCAST_ALGORITHM='ring'.*auto, tree, hierarchical, mpi"),
    ("UNISON_CHUNK_BYTES", "-5", r"UNISON_CHUNK_BYTES=.-5.*integer in \[1, 2147483647\]"),
    ("UNISON_CHUNK_BYTES", "1MB", r"UNISON_CHUNK_BYTES='1MB'.*integer in \[1, 2147483647\]"),
    ("UNISON_LOG_LEVEL", "loud", "UNISON_LOG_LEVEL='loud'.*DEBUG"),
])
def test_malformed_env_raises_value_error_naming_variable(var, value, expected):
    with pytest.raises(ValueError, match=expected):
        load_config({var: value})


def test_unknown_setting_and_typo_warning(caplog):
    with pytest.raises(ValueError, match="unknown Unison setting"):
        load_config({}, fusion="yes")
    with caplog.at_level("WARNING", logger="unison"):
        load_config({"UNISON_ALLREDUCE_ALGORTHM": "ring"})
    assert "UNISON_ALLREDUCE_ALGORTHM is not a Unison setting" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="unison"):  # a Horovod setting Unison has no counterpart of
        load_config({"HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_CYCLE_TIME": "2", "HOROVOD_EMPTY": " "})
    assert "HOROVOD_TIMELINE_MARK_CYCLES: Horovod setting(s) with no Unison counterpart" in caplog.text
    assert "HOROVOD_CYCLE_TIME" not in caplog.text and "HOROVOD_EMPTY" not in caplog.text


def test_init_rejects_malformed_env(fresh, monkeypatch):
    monkeypatch.setenv("UNISON_ALLREDUCE_ALGORITHM", "bogus")
    with pytest.raises(ValueError, match="UNISON_ALLREDUCE_ALGORITHM='bogus'"):
        unison.init()
    assert not unison.is_initialized()


def test_import_has_no_side_effects():
    code = ("import sys, unison; assert 'mpi4py.MPI' not in sys.modules; "
            "assert 'tensorflow' not in sys.modules and 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_result_pool_hands_out_aligned_arrays_and_never_a_live_one():
    from unison.common.pool import ALIGN, ResultPool

    pool = ResultPool()
    a = pool.empty((512, 1024), np.float32)
    assert a.ctypes.data % ALIGN == 0 and a.shape == (512, 1024) and a.dtype == np.float32
    view = a[3:].reshape(-1)  # only a view of it stays alive
    del a
    b = pool.empty((512, 1024), np.float32)
    assert not np.shares_memory(b, view)  # still referenced through the view: not reused
    address = b.ctypes.data
    del b
    c = pool.empty((512, 1024), np.float32)
    assert c.ctypes.data == address  # dropped everywhere: recycled


def test_result_pool_shares_buffers_across_shapes_and_lets_free_ones_go_when_full():
    """[Note: the pool's buffers] A leak audit (2026-12-06): results whose shapes changed every step filled each
    pool with buffers of shapes never asked for again (1 GiB per process set) and a table entry per shape."""
    from unison.common.pool import ALIGN, ResultPool, size_class

    assert size_class(256 << 10) == 256 << 10 and size_class((256 << 10) + 1) == (256 + 32) << 10
    assert all(n <= size_class(n) <= n * 1.125 for n in range(1 << 18, 1 << 21, 9973))
    pool = ResultPool(max_bytes=4 << 20)
    a = pool.empty((300, 256), np.float32)  # 300 KiB
    address = a.ctypes.data
    del a
    b = pool.empty((310, 256), np.int32)  # another shape and dtype of the same class: the same buffer
    assert b.ctypes.data == address and b.shape == (310, 256) and b.dtype == np.int32
    live = [b]
    for step in range(200):  # every step a new shape, the last result dropped
        out = pool.empty((257 + 3 * step, 1024), np.uint8)
        assert out.ctypes.data % ALIGN == 0 and out.shape == (257 + 3 * step, 1024)
        out[:] = 1
        assert pool.held <= pool.max_bytes
    assert len(pool._arrays) <= 6 and sum(map(len, pool._arrays.values())) <= 12
    live.append(out)
    del out
    for _ in range(60):  # the pool is full: the free buffers go, a buffer still used never
        pool.empty((900, 1024), np.uint8)
    assert any(raw is live[0].base for bufs in pool._arrays.values() for raw in bufs)
    assert live[0].shape == (310, 256)
    from unison.common.pool import SCAN_AFTER

    full = ResultPool(max_bytes=2 << 20)
    held = [full.empty((1 << 20,), np.uint8) for _ in range(2)]  # the pool is full of live results
    extra = full.empty((1 << 20,), np.uint8)  # nothing free: not pooled, and the next ones do not scan
    assert full.held == 2 << 20 and full._skip == SCAN_AFTER and extra.base is not held[0].base
    del held[0]
    again = full.empty((1 << 20,), np.uint8)  # its own class's free buffer is found without a scan
    assert full._skip == SCAN_AFTER and full.held == 2 << 20
    assert any(raw is again.base for bufs in full._arrays.values() for raw in bufs)


def test_keep_freed_memory_respects_user_malloc_settings(monkeypatch):
    import sys

    from unison.common import runtime

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    assert runtime.keep_freed_memory() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    assert runtime.keep_freed_memory() is sys.platform.startswith("linux")
    assert load_config(malloc_cache=False).malloc_cache is False
    monkeypatch.setenv("UNISON_MALLOC_CACHE", "0")
    assert load_config().malloc_cache is False


@pytest.mark.parametrize("env, at_import, at_init", [
    ({}, True, True),
    ({"UNISON_GC_FREEZE": "0"}, False, True),  # init(gc_freeze=True) below still freezes
    ({"HOROVOD_GC_FREEZE": "off"}, False, True),
])
def test_gc_freeze_moves_the_objects_alive_at_import_and_init(env, at_import, at_init):
    code = ("import gc, json, collections; before = gc.get_freeze_count(); import unison; imported = "
            "gc.get_freeze_count(); keep = [collections.OrderedDict() for _ in range(1000)]; "
            "unison.init(gc_freeze=True); inited = gc.get_freeze_count(); unison.shutdown(); "
            "print(json.dumps([before, imported, inited]))")
    environ = {k: v for k, v in os.environ.items() if not k.endswith("GC_FREEZE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**environ, **env})
    assert proc.returncode == 0, proc.stderr
    before, imported, inited = json.loads(proc.stdout.splitlines()[-1])
    assert before == 0
    assert (imported > 1000) is at_import and (imported == 0) is not at_import
    assert inited >= imported + 1000  # the objects made after the import, frozen by init


def test_gc_freeze_off_at_init_leaves_the_collector_alone(monkeypatch):
    code = ("import gc, unison; unison.init(gc_freeze=False); print(gc.get_freeze_count()); unison.shutdown()")
    environ = {k: v for k, v in os.environ.items() if not k.endswith("GC_FREEZE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**environ, "UNISON_GC_FREEZE": "no"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0"]
    assert load_config({"UNISON_GC_FREEZE": "0"}).gc_freeze is False and load_config({}).gc_freeze is True


def test_gc_freeze_false_at_init_undoes_the_freeze_made_at_import():
    """The argument wins over the environment for every setting; before 2026-12-07 init(gc_freeze=False)
    left the import's freeze (12,000 objects here) in place."""
    code = ("import gc, unison; imported = gc.get_freeze_count(); unison.init(gc_freeze=False); "
            "print(imported, gc.get_freeze_count()); unison.shutdown(); unison.init(); "
            "print(gc.get_freeze_count() > 0)")
    environ = {k: v for k, v in os.environ.items() if not k.endswith("GC_FREEZE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ)
    assert proc.returncode == 0, proc.stderr
    imported, after = map(int, proc.stdout.split()[:2])
    assert imported > 1000 and after == 0
    assert proc.stdout.split()[2] == "True"  # a later init() with the default freezes again


LOGS = """
import logging, sys, unison
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.DEBUG, format="MINE %(name)s %(message)s", stream=sys.stdout)
unison.init()
logging.getLogger("unison.common.engine.autotune").info("an info record")
logging.getLogger("unison.x").debug("a debug record")
unison.shutdown()
"""


@pytest.mark.parametrize("level, configured, shown", [
    ("DEBUG", "bare", ["INFO", "DEBUG"]),
    ("info", "bare", ["INFO"]),
    ("", "bare", []),  # the default, WARNING: nothing below it, and no handler of ours
    ("DEBUG", "configured", ["MINE"]),
])
def test_a_log_level_that_was_set_prints_its_records(level, configured, shown):
    """Before 2026-12-07 UNISON_LOG_LEVEL=DEBUG printed nothing: no handler took the records and Python's last
    resort prints WARNING and above only. A program's own logging set up before init() keeps its format."""
    environ = {k: v for k, v in os.environ.items() if not k.endswith("LOG_LEVEL")}
    environ["HOROVOD_LOG_LEVEL"] = level
    proc = subprocess.run([sys.executable, "-c", LOGS, configured], capture_output=True, text=True, timeout=120,
                          env=environ)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "record" in x]
    if configured == "configured":
        assert lines == ["MINE unison.common.engine.autotune an info record", "MINE unison.x a debug record"]
        return
    kinds = [x.split()[5] for x in lines]  # [date time unison rank 0 LEVEL logger] message
    assert kinds == shown, lines
    assert all(x.startswith("[") and " unison rank 0 " in x for x in lines), lines


def test_collective_header_words_are_named_and_decoded():
    """The agreement header's layout: named word offsets, decoded into a typed record."""
    from unison.collectives import header as H

    assert H.MATCH_WORDS == H.W_ERR + 1 and H.W_MYDIM0 == H.MATCH_WORDS
    assert H.W_ERRKIND < H.HEADER_WORDS and H._STRUCT.size == H.HEADER_BYTES
    rec = H.Header(H.MAGIC, int(H.Collective.ALLREDUCE), 2, 0, 1, -1, 0.5, 2.0, 3, 7, (4, 5) + (0,) * 6,
                   0, 560, 1, 7, 560, 0, 12, H.ERR_VALUE)
    block = np.zeros(H.BLOCK_BYTES, np.uint8)
    rec.pack_into(block)
    words = block[:H.HEADER_BYTES].view(np.int64)
    assert (words[H.W_COLLECTIVE], words[H.W_NDIM], words[H.W_DIM0], words[H.W_DIMS + 1]) == (1, 3, 7, 5)
    assert (words[H.W_ERR], words[H.W_ERRLEN], words[H.W_ERRKIND]) == (1, 12, H.ERR_VALUE)
    assert block[H.W_PRESCALE * 8:H.W_POSTSCALE * 8].view(np.float64)[0] == 0.5
    assert H.Header.unpack(block) == rec


def test_integer_average_helpers_widen_and_truncate_toward_zero():
    """[Note: integer average]: narrow integer averages sum in int64; floats and int64 do not widen."""
    from unison.collectives.reduce import accumulator, reduce_stack
    from unison.common.ops import ReduceOp

    for dt in (np.int8, np.uint8, np.int16, np.int32):
        assert accumulator(np.dtype(dt), ReduceOp.AVERAGE) == np.int64
        assert accumulator(np.dtype(dt), ReduceOp.SUM) is None
    assert accumulator(np.dtype(np.int64), ReduceOp.AVERAGE) is None
    assert accumulator(np.dtype(np.float16), ReduceOp.AVERAGE) is None
    stack = np.array([[200, 255, 1], [200, 255, 0]], np.uint8)
    out = np.empty(3, np.uint8)
    reduce_stack(stack, ReduceOp.AVERAGE, out, 2, 1.0)
    assert out.tolist() == [200, 255, 0]
    signed = np.array([[-3, -128, 127], [0, -128, 127], [0, -127, 126]], np.int8)
    got = np.empty(3, np.int8)
    reduce_stack(signed, ReduceOp.AVERAGE, got, 3, 1.0)
    assert got.tolist() == [-1, -127, 126]  # truncation toward zero, not floor


def test_the_tapes_agreement_cache_keys_hold_no_variable():
    """The None-gradient agreement cached while tracing keyed variables by ``ref()``, which kept every
    traced model's variables alive for good (a k-fold loop leaked each fold's model)."""
    import gc
    import weakref

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    from unison.tf_backend.functions import _variable_keys

    v, k = tf.Variable(np.zeros(4)), keras.Variable(np.zeros(3))
    keys = _variable_keys([v, k, tf.constant(1.0)])
    assert all(isinstance(key, str) for key in keys[:2]) and keys[2] is None and keys[0] != keys[1]
    assert _variable_keys([v, k]) == keys[:2]  # the same variables, the same key (a retrace hits)
    alive = weakref.ref(v)
    del v
    gc.collect()
    assert alive() is None


def test_reduce_ops_parse_from_their_names_and_integer_values():
    """Python and numpy integers (an op read back from an array) name the same op; bools, unknown values and
    names are refused, naming the valid ops (np.int64(1) was refused before 2026-12-05)."""
    from unison.common.ops import ReduceOp, parse_op

    for value in (ReduceOp.SUM, int(ReduceOp.SUM), np.int64(ReduceOp.SUM), np.uint8(ReduceOp.SUM), "sum", " Sum "):
        assert parse_op(value) is ReduceOp.SUM
    for bad in (True, np.bool_(True), 99, np.int32(99), "total", 1.0):
        with pytest.raises(ValueError, match="unknown reduce op .*valid ops are unison.Average"):
            parse_op(bad)


def test_host_callbacks_return_no_0d_values_which_tensorflow_leaks():
    """[Note: a callback's key is not 0-d] TensorFlow 2.21 leaks about 32 bytes per 0-d value a numpy_function
    returns (an audit measured 156 KB per 1000 steps of five collectives, linear, and none for one-element
    arrays): every graph collective's key was an np.int64, and Keras's host calls returned 0-d metric
    counts. The keys and the results of 0-d tensors now leave the callbacks as one element."""
    import tensorflow as tf

    from unison.keras import _host
    from unison.tf_backend import host_ops

    key = host_ops._submit(lambda a: (None, lambda _: [a * 2]), np.ones(2))
    assert key.shape == (1,) and key.dtype == np.int64
    np.testing.assert_array_equal(host_ops._collect(key)[0], [2.0, 2.0])
    returned = []

    def double(arrays, rows):
        return [a * 2 for a in arrays]

    real = tf.numpy_function

    def spy(func, inp, tout, **kwargs):
        def watched(*args):
            outs = func(*args)
            returned.extend(np.asarray(o).shape for o in (outs if isinstance(outs, list) else [outs]))
            return outs
        return real(watched, inp, tout, **kwargs)

    def tripled(a):  # a host_ops collective's start: no engine, the result at once
        return None, lambda _: [a * 3]

    tf.numpy_function = spy
    try:
        out = tf.function(lambda s, v: _host._tf_call(double, [s, v], None))(tf.constant(3.0), tf.ones(4))
        ran = tf.function(lambda s: host_ops.run(tripled, [s], [tf.float32], [tf.TensorShape([])]))(
            tf.constant(2.0))
    finally:
        tf.numpy_function = real
    assert returned == [(1,), (4,), (1,), (1,)]  # (_host's two results; host_ops's key and its scalar result)
    assert out[0].shape == () and float(out[0]) == 6.0 and out[1].shape == (4,)
    assert ran[0].shape == () and float(ran[0]) == 6.0


def test_unison_strategy_on_another_keras_backend_says_which_backend_and_what_to_use():
    """Run with KERAS_BACKEND=jax, UnisonStrategy accepted itself and then refused the model as made outside its
    scope (it was made in it: Keras on JAX builds no TensorFlow variables), which sent users to the wrong fix."""
    code = ("import unison.tf_backend as hvd\n"
            "try:\n    hvd.UnisonStrategy()\nexcept ValueError as e:\n    print('REFUSED', e)\n")
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED UnisonStrategy is a tf.distribute strategy" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "runs Keras on 'jax' (KERAS_BACKEND)" in out.stdout and "unison.keras.DataParallel" in out.stdout
