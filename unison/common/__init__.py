"""Framework-neutral core: runtime, settings, ops, dtypes. Never imports TensorFlow or PyTorch."""

__all__: list[str] = []

import gc as _gc

from unison.common.config import gc_freeze_wanted as _gc_freeze_wanted

#: whether importing Unison froze the collector's objects (``init(gc_freeze=False)`` undoes it)
FROZE_AT_IMPORT = _gc_freeze_wanted()
if FROZE_AT_IMPORT:  # the framework's modules, imported before us, leave the collector's full passes
    _gc.freeze()  # (see [Note: freezing the garbage collector's old objects] in runtime.py)
