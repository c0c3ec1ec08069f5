"""Grid.render_png and its layout, in one process (no MPI, no framework)."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from unison.common.tensor_parallel import Grid
from unison.common.tensor_parallel import grid as grid_module
from unison.common.tensor_parallel.render import GROUP_GAP, MAX_RANKS, layout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _no_job(monkeypatch):
    """As if Unison were not initialized (another test of this process may have started it)."""
    monkeypatch.setattr(grid_module, "_job_size", lambda: None)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (the first chunk, right after the signature)."""
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("sizes", [dict(dp=2, pp=2, tp=2, size=8), dict(tp=4)])
def test_render_png_writes_one_png_of_sensible_size(tmp_path, sizes):
    out = tmp_path / "grid.png"
    Grid(**sizes).render_png(out)
    data = out.read_bytes()
    width, height = png_size(data)
    assert 400 <= width <= 3500 and 250 <= height <= 2000, (width, height)
    assert len(data) > 5000  # boxes, numbers and the footer, not a blank canvas
    assert [p.name for p in tmp_path.iterdir()] == ["grid.png"]  # no temporary left behind


def test_more_stages_make_a_taller_picture_and_more_replicas_a_wider_one(tmp_path):
    def size(**kw):
        Grid(**kw).render_png(tmp_path / "g.png", stage_labels=None)
        return png_size((tmp_path / "g.png").read_bytes())

    base = size(dp=1, pp=1, tp=2)
    taller = size(dp=1, pp=3, tp=2)
    wider = size(dp=3, pp=1, tp=2)
    assert taller[1] > base[1] and wider[0] > base[0]


def test_render_png_takes_a_str_path_title_and_stage_labels(tmp_path):
    out = tmp_path / "g.png"
    Grid(dp=1, pp=3, tp=2).render_png(str(out), title="three stages", stage_labels=["embed", "blocks", "head"])
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_layout_puts_each_rank_once_at_its_coordinates():
    grid = Grid(dp=2, pp=3, tp=4)
    boxes = layout(grid)
    assert [b.rank for b in boxes] == list(range(24))
    for b in boxes:
        assert (b.stage, b.replica, b.shard) == tuple(grid.coords(b.rank))
        assert b.x == b.replica * (4 + GROUP_GAP) + b.shard  # shards side by side, a gap between replicas
    rows = {b.stage: b.y for b in boxes}
    assert all(b.y == rows[b.stage] for b in boxes) and rows[0] < rows[1] < rows[2]
    assert len({(b.x, b.y) for b in boxes}) == 24  # no two boxes overlap
    for group in grid.tp_groups():  # a tensor group is one row, neighbouring boxes
        xs = sorted(boxes[r].x for r in group)
        assert len({boxes[r].y for r in group}) == 1 and xs == [xs[0] + i for i in range(4)]


def test_bad_paths_raise_naming_the_path_and_the_fix(tmp_path):
    grid = Grid(dp=2, tp=2)
    missing = tmp_path / "no" / "such" / "grid.png"
    with pytest.raises(FileNotFoundError, match="does not exist; create it first") as err:
        grid.render_png(missing)
    assert str(missing.parent) in str(err.value)
    with pytest.raises(IsADirectoryError, match="is a folder; name a file inside it"):
        grid.render_png(tmp_path)
    with pytest.raises(ValueError, match="must name a file"):
        grid.render_png("")
    with pytest.raises(TypeError, match="must be a str or os.PathLike naming the PNG to write; received int 3"):
        grid.render_png(3)
    assert list(tmp_path.iterdir()) == []


def test_bad_stage_labels_and_huge_grids_raise(tmp_path):
    with pytest.raises(ValueError, match=r"one label per pipeline stage \(2\); received 1"):
        Grid(pp=2, tp=2).render_png(tmp_path / "g.png", stage_labels=["only one"])
    with pytest.raises(ValueError, match=f"at most {MAX_RANKS}.*Grid.describe"):
        Grid(dp=MAX_RANKS, tp=2).render_png(tmp_path / "g.png")
    assert list(tmp_path.iterdir()) == []


def test_importing_the_renderer_does_not_import_matplotlib():
    code = ("import sys, unison.common.tensor_parallel.render, unison.common.tensor_parallel; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
