"""Framework-neutral core: runtime, settings, ops, dtypes. Never imports TensorFlow or PyTorch."""

__all__: list[str] = []
