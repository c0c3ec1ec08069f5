"""unison.common.files.atomic_path: durable (fsync file, rename, fsync folder), exclusive, self-cleaning."""

from __future__ import annotations

import os
import time

import pytest

from unison.common.files import atomic_path, makedirs_durable


@pytest.fixture
def calls(monkeypatch):
    """Record every os.fsync (by inode) and os.replace, in order, and still perform them."""
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst, **kwargs):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_file_then_rename_then_folder_are_synced(tmp_path, calls):
    target = tmp_path / "model.weights.h5"
    target.write_text("old")
    with atomic_path(target) as tmp:
        assert tmp.endswith("model.weights.h5")  # writers pick formats from the suffixes
        with open(tmp, "w") as f:  # a writer that writes by path and closes the file itself
            f.write("new")
    assert target.read_text() == "new"
    file_ino, folder_ino = target.stat().st_ino, tmp_path.stat().st_ino
    kinds = [e[0] for e in calls]
    assert ("fsync", file_ino) in calls and ("fsync", folder_ino) in calls, calls
    i_file, i_folder = calls.index(("fsync", file_ino)), calls.index(("fsync", folder_ino))
    i_rename = kinds.index("replace")
    assert i_file < i_rename < i_folder, calls
    assert calls[i_rename][2] == os.fspath(target)


def test_directory_writer_syncs_every_file_and_folder(tmp_path, calls):
    target = tmp_path / "export"
    with atomic_path(target) as tmp:
        os.makedirs(os.path.join(tmp, "variables"))
        for rel in ("saved_model.pb", "variables/variables.index"):
            with open(os.path.join(tmp, rel), "w") as f:
                f.write(rel)
    assert (target / "variables" / "variables.index").read_text() == "variables/variables.index"
    synced = {e[1] for e in calls if e[0] == "fsync"}
    for p in (target / "saved_model.pb", target / "variables" / "variables.index", target / "variables",
              target, tmp_path):
        assert p.stat().st_ino in synced, p
    i_rename = [e[0] for e in calls].index("replace")
    assert calls[-1] == ("fsync", tmp_path.stat().st_ino) and i_rename == len(calls) - 2


def test_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "ckpt.json"
    target.write_text("old")
    with pytest.raises(OSError, match="disk full"), atomic_path(target) as tmp:
        with open(tmp, "w") as f:
            f.write("half")
        raise OSError("disk full")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["ckpt.json"]


def test_planted_symlink_at_the_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "out.txt"
    # the name a predictable scheme would pick: a writer that opens it by path would write through
    (tmp_path / f".unison-tmp-{os.getpid()}-out.txt").symlink_to(victim)
    with atomic_path(target) as tmp:
        assert not os.path.lexists(tmp)  # a fresh name nobody else can have planted anything at
        with open(tmp, "w") as f:
            f.write("new")
    assert victim.read_text() == "precious"
    assert target.read_text() == "new"


def test_leftovers_of_killed_writers_are_removed_at_the_next_save(tmp_path):
    old = time.time() - 3600  # before this process started
    stale_file = tmp_path / ".unison-tmp-4242-model.keras"
    stale_file.write_text("torn")
    stale_dir = tmp_path / ".unison-tmp-4243-k2j3h4ab-model.keras"
    (stale_dir / "model.keras").parent.mkdir()
    (stale_dir / "model.keras").write_text("torn")
    other_target = tmp_path / ".unison-tmp-4244-other.keras"
    other_target.write_text("kept: another file's")
    for p in (stale_file, stale_dir / "model.keras", stale_dir, other_target):
        os.utime(p, (old, old))
    live = tmp_path / ".unison-tmp-4245-model.keras"  # newer than this process: maybe a live writer
    live.write_text("in progress")
    with atomic_path(tmp_path / "model.keras") as tmp, open(tmp, "w") as f:
        f.write("new")
    assert sorted(os.listdir(tmp_path)) == sorted([".unison-tmp-4244-other.keras",
                                                   ".unison-tmp-4245-model.keras", "model.keras"])


def test_a_folder_without_directory_fsync_still_saves(tmp_path, monkeypatch):
    real = os.fsync

    def fsync(fd):
        import stat

        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")  # some network filesystems refuse it
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with atomic_path(tmp_path / "a.txt") as tmp, open(tmp, "w") as f:
        f.write("x")
    assert (tmp_path / "a.txt").read_text() == "x"


def test_new_folders_are_made_durable_in_their_parents(tmp_path, calls):
    """A checkpoint saved into folders that did not exist: each new folder's parent is flushed
    (before, only the checkpoint folder's own entries were, and a power loss could drop the new
    folders with the committed checkpoint in them)."""
    target = tmp_path / "run1" / "step_100"
    makedirs_durable(target)
    assert target.is_dir()
    synced = [e[1] for e in calls if e[0] == "fsync"]
    assert synced == [tmp_path.stat().st_ino, (tmp_path / "run1").stat().st_ino], calls
    calls.clear()
    makedirs_durable(target)  # nothing new: nothing to flush
    assert not calls


def test_a_missing_folder_is_named_and_keras_legacy_h5_gets_its_folder_made(tmp_path):
    """Before: mkdtemp's error named the private temporary path, not the missing folder; Keras's own legacy .h5
    save makes the folder, which the temporary beside the target came before."""
    from unison.common.files import atomic_keras_save

    with pytest.raises(FileNotFoundError, match=f"its folder '{tmp_path / 'nope'}' does not exist"):
        with atomic_path(tmp_path / "nope" / "model.keras"):
            pass

    def save(path, overwrite=True):
        with open(path, "w") as f:
            f.write("h5")

    atomic_keras_save(save, str(tmp_path / "made" / "model.h5"))
    assert (tmp_path / "made" / "model.h5").read_text() == "h5"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_keras_save(save, str(tmp_path / "missing" / "w.weights.h5"))
