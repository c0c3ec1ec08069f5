"""unison.common.checkpoints under mpirun: save at 4 ranks from a ZeRO plan, load at 4, 3, 2 and 1.

The outer test (tests/test_sharded_checkpoint_mpi.py) launches this file at 4 ranks first, which
saves into ``$CK_SHARED`` (sharded and consolidated) and loads back exactly; then at 3, 2 and 1
ranks, which load what the 4 ranks saved. Every value is compared bit for bit against the numpy
reference every rank rebuilds from seeds. The failure tests run at every rank count above 1.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from unison.common import checkpoints as ck
from unison.common.checkpoints import consolidated, storage
from unison.common.zero.plan import ParamSpec, ShardPlan

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
SAVED_AT = 4
SHARED = os.environ.get("CK_SHARED", "")
SHARDED = os.path.join(SHARED, "sharded")
SINGLE = os.path.join(SHARED, "single.ck")

# element counts 35, 7, 21, 3, 39, 1, 0: none but the empty one divides by 4
PARAMS = [ParamSpec("w1", (7, 5), "float32"), ParamSpec("b1", (7,), "float32"),
          ParamSpec("w2", (3, 7), "bfloat16"), ParamSpec("b2", (3,), "bfloat16"),
          ParamSpec("emb", (13, 3), "float64", group=1), ParamSpec("tiny", (1,), "float32"),
          ParamSpec("none", (0, 4), "float32")]
NAMES = [p.name for p in PARAMS] + [f"exp_avg/{p.name}" for p in PARAMS]


def reference() -> dict[str, np.ndarray]:
    """Every entry in full, the same on every rank (from seeds); replicated entries included."""
    g = np.random.default_rng(11)
    ref = {}
    for p in PARAMS:
        dt = ml_dtypes.bfloat16 if p.dtype == "bfloat16" else np.dtype(p.dtype)
        ref[p.name] = g.standard_normal(p.shape).astype(dt)
        ref[f"exp_avg/{p.name}"] = g.standard_normal(p.shape).astype(dt)
    ref["step"] = np.array(41, np.int64)
    ref["mask"] = g.random((2, 3)) > 0.5
    ref["only_rank1"] = np.arange(6, dtype=np.int16)
    return ref


REF = reference()


def zero_entries(world: int, rank: int) -> dict[str, object]:
    """What rank ``rank`` of ``world`` passes to a save: its ZeRO runs, cut from shard buffers."""
    plan = ShardPlan.build(PARAMS, world, bucket_bytes=64)  # several buckets
    shards = {key: np.zeros(plan.shard_numel(key), dtype=REF[_first(plan, key)].dtype) for key in plan.keys()}
    owned = plan.owned(rank)
    entries: dict[str, object] = {}
    for prefix in ("", "exp_avg/"):
        for p in PARAMS:
            if p.name not in owned:  # it holds nothing of it: it declares the entry (an empty one needs
                if rank == 0:        # somebody to), or leaves it out
                    entries[prefix + p.name] = ck.LocalShard(p.shape, p.dtype, [])
                continue
            key = (p.group, p.dtype)
            flat = REF[prefix + p.name].reshape(-1)
            runs = []
            for piece in owned[p.name]:
                shards[key][piece.offset:piece.offset + piece.length] = flat[piece.param_offset:
                                                                              piece.param_offset + piece.length]
                runs.append((piece.param_offset, shards[key][piece.offset:piece.offset + piece.length].copy()))
            entries[prefix + p.name] = ck.LocalShard(p.shape, p.dtype, runs)
    entries["step"] = REF["step"]
    entries["mask"] = ck.Replicated(REF["mask"])
    if rank >= 1:
        entries["only_rank1"] = ck.Replicated(REF["only_rank1"] + (rank - 1) * 100)  # rank 1's is written
    return entries


def _first(plan: ShardPlan, key: tuple[int, str]) -> str:
    return next(p.name for p in PARAMS if (p.group, p.dtype) == key)


def same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert got.tobytes() == want.tobytes()


def same_on_every_rank(message: str) -> None:
    assert len(set(WORLD.allgather(message))) == 1, WORLD.allgather(message)


@pytest.fixture
def scratch(tmp_path_factory):
    """A folder every rank sees (one machine: rank 0's temporary folder)."""
    return WORLD.bcast(str(tmp_path_factory.mktemp("scratch")) if R == 0 else None)


def forms():
    return [SHARDED, SINGLE]


# ------------------------------------------------------------------ save at 4, load exact
@pytest.mark.skipif(N != SAVED_AT, reason="the checkpoint is saved by the 4-rank launch")
def test_save_at_4_sharded_and_consolidated(monkeypatch):
    assert SHARED, "set CK_SHARED to a folder every launch sees"
    meta = {"step": 41, "world": N}
    m = ck.save_sharded(SHARDED, zero_entries(N, R), WORLD, metadata=meta)
    monkeypatch.setattr(consolidated, "CHUNK_BYTES", 24)  # many messages per run (every rank sets it)
    m1 = ck.save_consolidated(SINGLE, zero_entries(N, R), WORLD, metadata=meta)
    assert m.world == m1.world == 4 and m.metadata == m1.metadata == meta
    assert sorted(os.listdir(SHARDED)) == sorted([*m.files, ck.MANIFEST_NAME])
    assert len(m.files) == 4
    runs = m.entries["w1"].runs
    assert len(runs) >= 2 and {r.file for r in runs} != {runs[0].file}  # w1 really is split across ranks
    assert [r.file for r in m.entries["only_rank1"].runs] == [f"data-{m.save_id}-rank00001.bin"]


@pytest.mark.skipif(N != SAVED_AT, reason="exact reload is at the rank count that saved")
@pytest.mark.parametrize("where", ["sharded", "single"])
def test_load_at_4_gives_each_rank_its_own_runs(where):
    path = SHARDED if where == "sharded" else SINGLE
    mine = zero_entries(N, R)
    wanted = {n: [(s, len(a)) for s, a in e.runs] for n, e in mine.items() if isinstance(e, ck.LocalShard)}
    got = ck.load(path, wanted, WORLD)
    for name, parts in got.items():
        for (_, want), part in zip(mine[name].runs, parts, strict=True):
            same_bits(part, want)
    same_bits(ck.load(path, {"only_rank1": "full"}, WORLD)["only_rank1"], REF["only_rank1"])


# ------------------------------------------------------------------ load at any count
@pytest.mark.parametrize("where", ["sharded", "single"])
def test_every_rank_loads_everything_in_full(where):
    path = SHARDED if where == "sharded" else SINGLE
    m = ck.read_manifest(path)
    assert m.world == SAVED_AT and m.metadata == {"step": 41, "world": SAVED_AT}
    assert sorted(m.entries) == sorted(REF)
    got = ck.load(path, {name: "full" for name in REF}, WORLD, verify="all")
    for name, want in REF.items():
        same_bits(got[name], want)


@pytest.mark.parametrize("where", ["sharded", "single"])
def test_resharded_to_this_many_ranks(where):
    """Even splits (reshard_ranges) and a ZeRO plan for N ranks both read back the reference."""
    path = SHARDED if where == "sharded" else SINGLE
    m = ck.read_manifest(path)
    even = {name: ck.reshard_ranges(e.shape, N, R) for name, e in m.entries.items()}
    got = ck.load(path, even, WORLD)
    for name, [(s, n)] in even.items():
        same_bits(got[name][0], REF[name].reshape(-1)[s:s + n])
    owned = ShardPlan.build(PARAMS, N, bucket_bytes=48).owned(R)
    wanted = {f"exp_avg/{name}": [(p.param_offset, p.length) for p in pieces] for name, pieces in owned.items()}
    got = ck.load(path, wanted, WORLD)
    for name, ranges in wanted.items():
        for (s, n), part in zip(ranges, got[name], strict=True):
            same_bits(part, REF[name].reshape(-1)[s:s + n])


# ------------------------------------------------------------------ failures raise everywhere
multi = pytest.mark.skipif(N == 1, reason="needs two ranks to disagree")


@multi
def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(scratch, monkeypatch):
    path = os.path.join(scratch, "ck")
    ck.save_sharded(path, zero_entries(N, R), WORLD)
    before = sorted(os.listdir(path))
    bad = 2 if N > 2 else 1
    if R == bad:
        def unwritable(file, *args):
            raise PermissionError(13, "Permission denied", file)
        monkeypatch.setattr(storage, "write_data_file", unwritable)
    expected = f"rank {bad}: could not write its data file .*Permission denied"
    with pytest.raises(ck.CheckpointError, match=expected) as info:
        ck.save_sharded(path, {"step": REF["step"] + 1}, WORLD)
    assert f"-rank{bad:05d}.bin" in str(info.value)
    same_on_every_rank(str(info.value))
    WORLD.Barrier()
    assert sorted(os.listdir(path)) == before  # the others removed their files of the failed save
    same_bits(ck.load(path, {"step": "full"}, WORLD)["step"], REF["step"])


@multi
def test_rank0_that_cannot_write_fails_a_consolidated_save_everywhere(scratch):
    blocker = os.path.join(scratch, "a-file")
    if R == 0:
        with open(blocker, "w") as f:
            f.write("not a folder")
    WORLD.Barrier()
    with pytest.raises(ck.CheckpointError, match="rank 0: could not write .*a-file") as info:
        ck.save_consolidated(os.path.join(blocker, "one.ck"), zero_entries(N, R), WORLD)
    same_on_every_rank(str(info.value))


@multi
def test_different_paths_raise_on_every_rank(scratch):
    with pytest.raises(ck.CheckpointError, match="the ranks passed different paths") as info:
        ck.save_sharded(os.path.join(scratch, f"ck{min(R, 1)}"), {"step": REF["step"]}, WORLD)
    assert "rank 0: " in str(info.value) and "ck1" in str(info.value)
    same_on_every_rank(str(info.value))


@multi
def test_ranks_running_different_kinds_of_save_raise_on_every_rank(scratch):
    """consolidated= on some ranks only: each rank waited in its own kind's next collective (a hang, before
    2026-12-06; found by an audit)."""
    save = ck.save_consolidated if R == 0 else ck.save_sharded
    with pytest.raises(ck.CheckpointError, match="the ranks ran different kinds of save on one") as info:
        save(os.path.join(scratch, "mixed"), {"step": REF["step"]}, WORLD)
    assert "rank 0: save_consolidated" in str(info.value) and "save_sharded" in str(info.value)
    same_on_every_rank(str(info.value))


@multi
def test_a_failure_tidying_up_after_the_commit_does_not_fail_the_save(scratch, monkeypatch):
    """Removing older data files once the manifest is in place is tidying up: it raised on rank 0 alone and
    left the others waiting for it (before 2026-12-06; found by an audit). Now the save returns everywhere."""
    from unison.common.checkpoints import sharded

    path = os.path.join(scratch, "tidy")
    ck.save_sharded(path, {"step": REF["step"]}, WORLD)
    if R == 0:
        def broken(folder, manifest):
            raise OSError(5, "Input/output error (injected)")

        monkeypatch.setattr(sharded, "remove_unreferenced", broken)
    manifest = ck.save_sharded(path, {"step": REF["step"]}, WORLD)
    assert ck.read_manifest(path).save_id == manifest.save_id
    same_on_every_rank(manifest.save_id)


@multi
def test_different_declarations_and_gaps_raise_on_every_rank(scratch):
    path = os.path.join(scratch, "ck")
    shape = (4, 5) if R == 1 else (4, 4)
    with pytest.raises(ck.CheckpointError, match=r"entry 'w' is declared differently across ranks") as info:
        ck.save_sharded(path, {"w": ck.LocalShard(shape, "float32", [])}, WORLD)
    assert "rank 1: sharded shape (4, 5) float32" in str(info.value)
    same_on_every_rank(str(info.value))
    entries = zero_entries(N, R)
    if R == N - 1:
        del entries["exp_avg/emb"]  # the last rank forgets its part
    with pytest.raises(ck.CheckpointError, match=r"entry 'exp_avg/emb' \(39 elements\): elements \[\d+, \d+\) are "
                                                 "given by no rank") as info:
        ck.save_consolidated(os.path.join(scratch, "one.ck"), entries, WORLD)
    same_on_every_rank(str(info.value))
    assert not os.path.exists(path)


@multi
def test_a_folder_rank0_cannot_see_into_raises_on_every_rank(scratch, tmp_path, monkeypatch):
    path = os.path.join(scratch, "ck")
    real = storage.write_data_file
    if R > 0:  # these ranks' files land on a disk rank 0 does not see
        private = str(tmp_path / "private")
        os.makedirs(private)
        monkeypatch.setattr(storage, "write_data_file",
                            lambda file, *a: real(os.path.join(private, os.path.basename(file)), *a))
    expected = "the folder is not shared: rank 0 cannot see files written by"
    with pytest.raises(ck.CheckpointError, match=expected) as info:
        ck.save_sharded(path, zero_entries(N, R), WORLD)
    assert (f"rank {list(range(1, N))[0]}" if N == 2 else f"ranks {list(range(1, N))}") in str(info.value)
    assert "save consolidated" in str(info.value)
    same_on_every_rank(str(info.value))
    assert not os.path.exists(os.path.join(path, ck.MANIFEST_NAME))


@multi
def test_ranks_loading_different_checkpoints_raise_on_every_rank(scratch):
    a, b = os.path.join(scratch, "a"), os.path.join(scratch, "b")
    ck.save_sharded(a, {"step": REF["step"]}, WORLD)
    ck.save_sharded(b, {"step": REF["step"]}, WORLD)
    with pytest.raises(ck.CheckpointError, match="the ranks found different checkpoints") as info:
        ck.load(a if R == 0 else b, {"step": "full"}, WORLD)
    assert "rank 0 sees save" in str(info.value)
    same_on_every_rank(str(info.value))
    with pytest.raises(ck.CheckpointError, match=f"rank {N - 1}: entry 'nope' is not in the checkpoint") as info:
        ck.load(a, {"step": "full"} if R < N - 1 else {"nope": "full"}, WORLD)
    same_on_every_rank(str(info.value))
