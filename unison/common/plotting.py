"""Optional drawing: matplotlib is an extra (``examples``, ``dev``), imported only to draw a PNG.

Every drawing function (pipeline schedules, tensor-parallel grids, ``python -m unison.perfmodel
--png``) calls :func:`require_matplotlib` first, so a missing matplotlib is a message naming the fix,
not a ModuleNotFoundError from the middle of a plot.
"""

from __future__ import annotations

__all__ = ["require_matplotlib"]


def require_matplotlib(purpose: str) -> None:
    """Import matplotlib, or raise an ImportError that names the fix.

    Args:
        purpose: what needs it, for the message (``"render_png"``).

    Raises:
        ImportError: matplotlib (or one of its own dependencies) cannot be imported.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{purpose} needs matplotlib, which failed to import ({exc}): pip install matplotlib "
                          "(or the checkout's [examples] extra: pip install '.[examples]')") from exc
