"""unison.common.checkpoints in one process: round trips, ranges, corruption, commit, bad input."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

from unison.common import checkpoints as ck
from unison.common.checkpoints import sharded
from unison.common.checkpoints.format import MAGIC, PREFIX

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
          "uint32", "uint64", "bool", "complex64"]


def sample(shape, dtype, seed=0):
    rs = np.random.RandomState(seed)
    if dtype == "bool":
        return rs.rand(*shape) > 0.5 if shape else np.bool_(True)
    if dtype == "bfloat16":
        return np.asarray(rs.randn(*shape)).astype(ml_dtypes.bfloat16)
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return np.asarray(rs.randint(max(info.min, -1000), min(info.max, 1000), size=shape)).astype(dtype)
    return np.asarray(rs.randn(*shape) * 100).astype(dtype)


def same_bits(got, want):
    """Bit-exact equality (NaN payloads and -0.0 included), dtype and shape too."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert got.tobytes() == want.tobytes()


def split_runs(flat, cuts):
    """``flat`` cut at ``cuts`` into ``(start, array)`` runs."""
    edges = [0, *cuts, len(flat)]
    return [(a, flat[a:b]) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def save(form, path, entries, **kw):
    return (ck.save_sharded if form == "sharded" else ck.save_consolidated)(path, entries, **kw)


def target(form, tmp_path):
    return str(tmp_path / ("ck" if form == "sharded" else "ck.unison"))


FORMS = ["sharded", "consolidated"]


@pytest.mark.parametrize("form", FORMS)
def test_round_trip_every_dtype_and_odd_shapes(form, tmp_path):
    arrays = {f"{dt}-{i}": sample(shape, dt, i) for i, shape in enumerate([(7, 3), (), (0,), (2, 0, 3), (11,)])
              for dt in DTYPES}
    arrays["nan"] = np.array([np.nan, -0.0, np.inf], np.float32)
    entries = {}
    for n, a in arrays.items():  # even entries as runs, odd ones replicated
        if len(entries) % 2 and a.size > 2:
            entries[n] = ck.LocalShard(a.shape, a.dtype, split_runs(a.reshape(-1), [1, a.size // 2]))
        else:
            entries[n] = ck.Replicated(a) if len(entries) % 3 else a
    path = target(form, tmp_path)
    save(form, path, entries, metadata={"step": 7, "note": "x"})
    got = ck.load(path, {n: "full" for n in arrays})
    for n, a in arrays.items():
        same_bits(got[n], a)
    m = ck.read_manifest(path)
    assert m.metadata == {"step": 7, "note": "x"} and m.world == 1 and m.layout == form
    assert m.entries["bfloat16-0"].shape == (7, 3) and m.entries["bfloat16-0"].dtype == "bfloat16"
    assert m.entries["bool-1"].shape == () and m.entries["int8-2"].numel == 0


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("verify", ["read", "all"])
def test_ranges_straddling_runs(form, verify, tmp_path):
    w = sample((6, 7), "float32", 1)
    flat = w.reshape(-1)
    path = target(form, tmp_path)
    save(form, path, {"w": ck.LocalShard(w.shape, "float32", split_runs(flat, [5, 6, 20, 33]))})
    ranges = [(0, 42), (3, 10), (5, 1), (4, 3), (19, 15), (41, 1), (0, 0), (42, 0), (6, 14)]
    got = ck.load(path, {"w": ranges}, verify=verify)["w"]
    for (s, n), g in zip(ranges, got, strict=True):
        same_bits(g, flat[s:s + n])


def test_reshard_ranges_split_evenly_and_cover():
    for numel, world in [(10, 4), (3, 4), (0, 3), (12, 3), (1, 1)]:
        parts = [ck.reshard_ranges((numel,), world, r)[0] for r in range(world)]
        assert [s for s, _ in parts] == list(np.cumsum([0] + [n for _, n in parts])[:-1])
        assert sum(n for _, n in parts) == numel and max(n for _, n in parts) - min(n for _, n in parts) <= 1
    with pytest.raises(ValueError, match="rank=4"):
        ck.reshard_ranges((5,), 4, 4)


def save_two_files(tmp_path):
    """A sharded checkpoint whose entry 'w' has two runs; returns path, array and the manifest."""
    w = sample((40,), "float64", 2)
    path = str(tmp_path / "ck")
    m = ck.save_sharded(path, {"w": ck.LocalShard((40,), "float64", split_runs(w, [15])), "b": np.arange(3)})
    return path, w, m


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_fails_the_crc_naming_file_and_entry(tmp_path):
    path, w, m = save_two_files(tmp_path)
    run = m.entries["w"].runs[1]
    data = os.path.join(path, run.file)
    flip_byte(data, run.offset + 3)
    with pytest.raises(ck.CheckpointError, match="corrupt") as info:
        ck.load(path, {"w": "full"})
    assert repr(data) in str(info.value) and "'w'" in str(info.value) and "[15, 40)" in str(info.value)
    same_bits(ck.load(path, {"w": [(0, 15)]})["w"][0], w[:15])  # the intact run still loads
    with pytest.raises(ck.CheckpointError, match="corrupt"):  # a partial read of the bad run: only with 'all'
        ck.load(path, {"w": [(30, 2)]}, verify="all")


def test_flipped_byte_in_a_consolidated_file(tmp_path):
    w = sample((33,), "int32", 3)
    path = str(tmp_path / "one.ck")
    m = ck.save_consolidated(path, {"w": w})
    with open(path, "rb") as f:
        _, base = ck.format.decode_header(f, path)
    flip_byte(path, base + m.entries["w"].runs[0].offset + 10)
    with pytest.raises(ck.CheckpointError, match=f"{path!r} is corrupt: entry 'w'"):
        ck.load(path, {"w": "full"})


def test_a_partial_read_checks_every_block_it_touches(tmp_path):
    """A consolidated file holds each entry as one run, so a shard's read of part of it (ZeRO, tensor
    parallel) checked no CRC, and a flipped byte loaded as a wrong number (before 2026-12-07)."""
    block = ck.format.CRC_BLOCK_BYTES
    w = sample((3 * block // 8 + 100,), "float64", 4)  # 3 whole blocks of bytes and a short fourth
    path = str(tmp_path / "one.ck")
    m = ck.save_consolidated(path, {"w": w, "small": w[:50]})
    run = m.entries["w"].runs[0]
    assert len(run.blocks) == 4 and m.entries["small"].runs[0].blocks == ()
    per = block // 8
    ranges = [(0, 1), (per - 1, 2), (per, per), (per + 3, 2 * per), (3 * per + 99, 1), (10, 3 * per + 80), (5, 0)]
    for verify in ("read", "all"):
        for (s, n), g in zip(ranges, ck.load(path, {"w": ranges}, verify=verify)["w"], strict=True):
            same_bits(g, w[s:s + n])
    with open(path, "rb") as f:
        _, base = ck.format.decode_header(f, path)
    flip_byte(path, base + run.offset + 2 * block + 5)  # in the third block
    flip_byte(path, base + m.entries["small"].runs[0].offset + 9)
    for wanted in ([(2 * per + 1, 1)], [(per - 1, per + 2)], [(3 * per, 1), (2 * per + 7, 1)]):
        with pytest.raises(ck.CheckpointError, match=r"corrupt: entry 'w', bytes \[2097152, 3145728\)"):
            ck.load(path, {"w": wanted})
    with pytest.raises(ck.CheckpointError, match="corrupt: entry 'small'"):  # a run of one block: read whole
        ck.load(path, {"small": [(30, 2)]})
    for s, n in [(0, per), (per + 5, per - 5), (3 * per, 100)]:  # blocks without the flipped byte
        same_bits(ck.load(path, {"w": [(s, n)]})["w"][0], w[s:s + n])


def test_a_checkpoint_without_block_crcs_still_loads(tmp_path):
    """Checkpoints written before block CRCs existed: their partial reads are checked only with 'all'."""
    w = sample((ck.format.CRC_BLOCK_BYTES // 4,), "float64", 5)
    path = str(tmp_path / "ck")
    ck.save_sharded(path, {"w": w})
    manifest = os.path.join(path, "manifest.json")
    with open(manifest) as f:
        doc = json.load(f)
    for run in doc["entries"]["w"]["runs"]:
        assert len(run.pop("block_crc32")) == 2
    with open(manifest, "w") as f:
        json.dump(doc, f)
    for verify in ("read", "all"):
        same_bits(ck.load(path, {"w": [(7, 200_000)]}, verify=verify)["w"][0], w[7:200_007])


def test_truncated_and_missing_data_files(tmp_path):
    path, _, m = save_two_files(tmp_path)
    data = os.path.join(path, m.entries["w"].runs[0].file)
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(size - 8)
    with pytest.raises(ck.CheckpointError, match="is truncated: it has") as info:
        ck.load(path, {"w": "full"})
    assert repr(data) in str(info.value) and "'w'" in str(info.value)
    os.remove(data)
    with pytest.raises(ck.CheckpointError, match="cannot open data file") as info:
        ck.load(path, {"b": "full"})
    assert repr(data) in str(info.value)


def test_truncated_consolidated_file(tmp_path):
    path = str(tmp_path / "one.ck")
    ck.save_consolidated(path, {"w": sample((100,), "float32")})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ck.CheckpointError, match="is truncated: entry 'w'"):
        ck.load(path, {"w": "full"})
    with open(path, "r+b") as f:
        f.truncate(20)
    with pytest.raises(ck.CheckpointError, match="is truncated: its header"):
        ck.read_manifest(path)


def test_unknown_entry_bad_ranges_and_no_checkpoint(tmp_path):
    path, _, _ = save_two_files(tmp_path)
    with pytest.raises(ck.CheckpointError, match=r"entry 'nope' is not in the checkpoint.*\['b', 'w'\]"):
        ck.load(path, {"nope": "full"})
    with pytest.raises(ck.CheckpointError, match=r"range \[30, 41\) is outside the entry's 40 elements"):
        ck.load(path, {"w": [(30, 11)]})
    with pytest.raises(ck.CheckpointError, match="must be two integers >= 0"):
        ck.load(path, {"w": [(-1, 2)]})
    with pytest.raises(ck.CheckpointError, match="neither 'full' nor a list"):
        ck.load(path, {"w": "half"})
    with pytest.raises(ck.CheckpointError, match="no manifest.json"):
        ck.load(str(tmp_path), {"w": "full"})
    with pytest.raises(ck.CheckpointError, match="no checkpoint at"):
        ck.read_manifest(str(tmp_path / "missing"))
    with open(tmp_path / "junk", "wb") as f:
        f.write(b"PK\3\4 something else entirely")
    with pytest.raises(ck.CheckpointError, match="is not a Unison checkpoint"):
        ck.read_manifest(str(tmp_path / "junk"))


def test_a_newer_format_version_is_refused(tmp_path):
    path, _, _ = save_two_files(tmp_path)
    manifest = os.path.join(path, ck.MANIFEST_NAME)
    with open(manifest) as f:
        doc = json.load(f)
    doc["version"] = ck.VERSION + 1
    with open(manifest, "w") as f:
        json.dump(doc, f)
    with pytest.raises(ck.CheckpointError, match=f"format version {ck.VERSION + 1}, newer .* upgrade Unison"):
        ck.load(path, {"w": "full"})
    one = str(tmp_path / "one.ck")
    ck.save_consolidated(one, {"w": np.zeros(3)})
    with open(one, "r+b") as f:
        f.seek(len(MAGIC))
        f.write(PREFIX.pack(MAGIC, ck.VERSION + 1, 0)[len(MAGIC):len(MAGIC) + 4])
    with pytest.raises(ck.CheckpointError, match=f"format version {ck.VERSION + 1}, newer"):
        ck.read_manifest(one)


@pytest.mark.parametrize("form", FORMS)
def test_gaps_and_overlaps_are_refused_naming_entry_and_range(form, tmp_path):
    flat = np.arange(10, dtype=np.float32)
    path = target(form, tmp_path)
    gap = ck.LocalShard((10,), "float32", [(0, flat[:4]), (6, flat[6:])])
    expected = r"entry 'w' \(10 elements\): elements \[4, 6\) are given by no rank"
    with pytest.raises(ck.CheckpointError, match=expected):
        save(form, path, {"w": gap})
    tail = ck.LocalShard((2, 5), "float32", [(0, flat[:7])])
    with pytest.raises(ck.CheckpointError, match=r"elements \[7, 10\) are given by no rank"):
        save(form, path, {"w": tail})
    over = ck.LocalShard((10,), "float32", [(0, flat[:6]), (4, flat[4:])])
    with pytest.raises(ck.CheckpointError, match=r"elements \[4, 6\) are given by both rank 0 and rank 0"):
        save(form, path, {"w": over})
    assert not os.path.exists(path)  # nothing written


def test_bad_entries_are_refused_before_writing(tmp_path):
    path = str(tmp_path / "ck")
    cases = [
        ({"w": [1, 2]}, "is a list; pass a LocalShard"),
        ({"w": ck.LocalShard((4,), "float32", [(0, np.zeros(4, np.float64))])}, "runs are 1-D arrays of the"),
        ({"w": ck.LocalShard((4,), "float32", [(0, np.zeros((2, 2), np.float32))])}, "of shape \\(2, 2\\)"),
        ({"w": ck.LocalShard((4,), "float32", [(2, np.zeros(3, np.float32))])}, r"\[2, 5\) ends past"),
        ({"w": ck.LocalShard((-1,), "float32", [])}, "must be a tuple of integers >= 0"),
        ({"w": np.array(["a"], dtype=object)}, "cannot be stored as raw bytes"),
        ({"": np.zeros(1)}, "non-empty strings"),
    ]
    for entries, message in cases:
        with pytest.raises(ck.CheckpointError, match=message):
            ck.save_sharded(path, entries)
    with pytest.raises(ck.CheckpointError, match="JSON-serializable"):
        ck.save_sharded(path, {"w": np.zeros(1)}, metadata={"a": np.zeros(2)})
    assert not os.path.exists(path)


def test_crash_before_commit_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    old = sample((20,), "float32", 4)
    ck.save_sharded(path, {"w": old}, metadata={"step": 1})
    first = set(os.listdir(path))

    def killed(*args, **kwargs):  # not an Exception: like a process killed here, nothing cleans up
        raise KeyboardInterrupt("killed after the data files, before the manifest")

    monkeypatch.setattr(sharded, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        ck.save_sharded(path, {"w": old + 1}, metadata={"step": 2})
    monkeypatch.undo()
    leftovers = set(os.listdir(path)) - first
    assert len(leftovers) == 1 and next(iter(leftovers)).startswith("data-")
    same_bits(ck.load(path, {"w": "full"})["w"], old)  # the previous checkpoint, whole
    assert ck.read_manifest(path).metadata == {"step": 1}
    ck.save_sharded(path, {"w": old + 2}, metadata={"step": 3})
    names = sorted(os.listdir(path))
    assert len(names) == 2 and names[1] == ck.MANIFEST_NAME and not (set(names) & (first | leftovers) - {
        ck.MANIFEST_NAME})
    same_bits(ck.load(path, {"w": "full"})["w"], old + 2)


def test_failed_write_raises_and_removes_its_file(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    ck.save_sharded(path, {"w": np.ones(4)})
    before = sorted(os.listdir(path))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharded, "write_manifest", full_disk)
    with pytest.raises(ck.CheckpointError, match="could not write .*manifest.json.*No space left"):
        ck.save_sharded(path, {"w": np.zeros(4)})
    assert sorted(os.listdir(path)) == before  # this save's data file is gone, the old one stays
    same_bits(ck.load(path, {"w": "full"})["w"], np.ones(4))


def test_a_failure_after_the_manifest_is_in_place_keeps_the_committed_save(tmp_path, monkeypatch):
    """The folder's fsync fails after the rename: the new manifest is the commit, so its data must stay
    (the save used to delete them, leaving a manifest naming missing files: neither save loaded)."""
    from unison.common import files

    path = str(tmp_path / "ck")
    ck.save_sharded(path, {"w": np.ones(4)})
    real, first = files.fsync, ck.read_manifest(path).save_id

    def failing(target, directory):  # once the new manifest is in place (the data files' folder flush is earlier)
        manifest = os.path.join(target, ck.MANIFEST_NAME)
        if directory and os.path.exists(manifest) and ck.read_manifest(target).save_id != first:
            raise OSError(5, "Input/output error")
        real(target, directory)

    monkeypatch.setattr(files, "fsync", failing)
    with pytest.raises(ck.CheckpointError, match="this save is committed and loads"):
        ck.save_sharded(path, {"w": np.zeros(4)})
    monkeypatch.undo()
    same_bits(ck.load(path, {"w": "full"})["w"], np.zeros(4))


def test_an_empty_run_shares_its_start_with_a_real_one_in_either_order(tmp_path):
    data = np.arange(6.0)
    for runs in ([(0, data[:0]), (0, data)], [(0, data), (0, data[:0])]):
        path = str(tmp_path / f"ck{len(runs[0][1])}")
        ck.save_sharded(path, {"w": ck.LocalShard((6,), "float64", runs)})
        same_bits(ck.load(path, {"w": "full"})["w"], data)


def test_a_consolidated_file_replaced_during_a_load_is_never_read_as_the_old_one(tmp_path, monkeypatch):
    """A save commits between the header read and the data read: the load used to take the new file's
    bytes at the old header's offsets (values of no save at all); now it says what happened."""
    from unison.common.checkpoints import reader

    path = str(tmp_path / "one.ck")
    ck.save_consolidated(path, {"w": np.arange(5.0)})
    real = reader._open_manifest

    def then_a_save_commits(target):
        found = real(target)
        ck.save_consolidated(path, {"w": np.arange(5.0) + 1000, "more": np.zeros(3)}, metadata={"k": "v" * 50})
        return found

    monkeypatch.setattr(reader, "_open_manifest", then_a_save_commits)
    with pytest.raises(ck.CheckpointError, match="was replaced by another save while this load read it"):
        ck.load(path, {"w": [(1, 3)]})
    monkeypatch.undo()
    same_bits(ck.load(path, {"w": "full"})["w"], np.arange(5.0) + 1000)


def test_consolidated_replaces_atomically_and_fails_cleanly(tmp_path):
    path = str(tmp_path / "sub" / "one.ck")
    ck.save_consolidated(path, {"w": np.arange(5)})
    ck.save_consolidated(path, {"w": np.arange(6)}, metadata={"v": 2})
    same_bits(ck.load(path, {"w": "full"})["w"], np.arange(6))
    assert sorted(os.listdir(tmp_path / "sub")) == ["one.ck"]
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ck.CheckpointError, match="could not write .*a-file.*NotADirectoryError|FileExistsError"):
        ck.save_consolidated(str(blocker / "one.ck"), {"w": np.arange(5)})


def test_chunked_gather_path_is_exercised_in_one_process(tmp_path, monkeypatch):
    """Chunk sizes smaller than an element still move whole elements (the rule the MPI test relies on)."""
    from unison.common.checkpoints import consolidated
    from unison.common.checkpoints.layout import Slot

    monkeypatch.setattr(consolidated, "CHUNK_BYTES", 10)
    assert consolidated._chunks(Slot("w", 3, 7), 4) == [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert consolidated._chunks(Slot("w", 0, 3), 16) == [(0, 1), (1, 1), (2, 1)]
    assert consolidated._chunks(Slot("w", 0, 0), 4) == []


# ----------------------------------------------------------------- damage and durability (audit, 2026-12-05)
def test_a_manifest_whose_shape_does_not_match_its_runs_is_refused(tmp_path):
    """One damaged digit ([3, 4] read as [2, 4]) loaded the first 8 of 12 elements as the whole entry:
    a partial read checks no CRC."""
    path = str(tmp_path / "ck")
    ck.save_sharded(path, {"w": np.arange(12.0).reshape(3, 4)})
    manifest = os.path.join(path, ck.MANIFEST_NAME)
    with open(manifest) as f:
        doc = json.load(f)
    doc["entries"]["w"]["shape"] = [2, 4]
    with open(manifest, "w") as f:
        json.dump(doc, f)
    with pytest.raises(ck.CheckpointError, match="malformed.*cover 12 elements but its shape"):
        ck.load(path, {"w": "full"})


def test_a_consolidated_header_length_beyond_the_file_is_refused_naming_it(tmp_path):
    """A damaged length of 2**62 raised a bare MemoryError."""
    path = str(tmp_path / "one.ck")
    ck.save_consolidated(path, {"w": np.ones(3)})
    with open(path, "r+b") as f:
        magic, version, _ = PREFIX.unpack(f.read(PREFIX.size))
        f.seek(0)
        f.write(PREFIX.pack(magic, version, 2 ** 62))
    with pytest.raises(ck.CheckpointError, match="one.ck' is truncated: its header needs"):
        ck.read_manifest(path)


def test_an_io_error_flushing_the_data_files_folder_fails_the_save(tmp_path, monkeypatch):
    """It was logged at debug level and dropped: the save committed as durable. A filesystem that cannot
    flush folders (EINVAL) is still skipped."""
    import errno
    import stat

    from unison.common.checkpoints import storage

    real, code = os.fsync, [errno.EIO]

    def failing(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code[0], os.strerror(code[0]))
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        storage.fsync_folder(str(tmp_path))
    with pytest.raises((ck.CheckpointError, OSError), match="Input/output error"):
        ck.save_sharded(str(tmp_path / "ck"), {"w": np.ones(4)})
    code[0] = errno.EINVAL
    storage.fsync_folder(str(tmp_path))
    ck.save_sharded(str(tmp_path / "ck2"), {"w": np.ones(4)})


def test_temporary_names_stay_within_the_filesystems_byte_limit(tmp_path, caplog):
    """180 characters of emoji made a temporary name over NAME_MAX (255 bytes); removing a file that is
    not there warned."""
    from unison.common import files
    from unison.common.checkpoints import storage

    name = "e" * 10 + "\N{SLIGHTLY SMILING FACE}" * 55 + ".u"  # 232 bytes: a valid name
    with files.atomic_path(tmp_path / name) as tmp:
        with open(tmp, "w") as f:
            f.write("x")
    assert (tmp_path / name).read_text() == "x"
    with caplog.at_level("WARNING"):
        storage.remove_quietly(str(tmp_path / "not-there"))
    assert not caplog.records


def test_a_temporary_name_never_starts_inside_a_character():
    from unison.common import files

    tag = files._tag("\N{CJK UNIFIED IDEOGRAPH-6A21}" * 61 + ".weights.h5")
    assert len(os.fsencode(tag)) <= 180 and tag.encode("utf-8")  # (a cut character left a lone surrogate)
