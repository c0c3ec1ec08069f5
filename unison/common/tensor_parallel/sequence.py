"""Sequence parallelism's checks, shared by both backends' layers and operators.

See the PyTorch ``tensor_parallel_comm.py`` docstring for the operators and
docs/tensor_parallel.md ("Sequence parallelism") for what the option changes.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_column_options", "check_row_options", "sequence_problem"]


def check_column_options(gather_output: bool, sequence_parallel: bool) -> None:
    """Raise for a column layer that would both gather its output and take split positions."""
    if gather_output and sequence_parallel:
        raise ValueError("ColumnParallelLinear: gather_output=True and sequence_parallel=True together are not "
                         "supported; keep the output split (a RowParallelLinear follows) or gather it yourself")


def check_row_options(input_is_parallel: bool, sequence_parallel: bool) -> None:
    """Raise for a row layer that would reduce-scatter positions of an input it must split first."""
    if sequence_parallel and not input_is_parallel:
        raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (the input is a "
                         "ColumnParallelLinear's output); received input_is_parallel=False")


def sequence_problem(shape: Sequence[int | None] | None, parts: int, what: str, whole: bool) -> str | None:
    """Why a tensor of ``shape`` cannot be split along dimension 1 over ``parts`` ranks, or None.

    Args:
        shape: the tensor's shape (None: unknown rank; a None length: unknown at trace time).
        whole: the tensor holds every position, so the group must divide their number.
    """
    if shape is None or len(shape) < 2:
        return (f"{what}: sequence parallelism needs (batch, seq, ...) tensors; received shape "
                f"{None if shape is None else tuple(shape)}")
    seq = shape[1]
    if seq is None:
        if parts == 1:
            return None
        return (f"{what}: sequence parallelism needs a statically known sequence length; received shape "
                f"{tuple(shape)}. Give the input a fixed sequence length")
    if whole and seq % parts:
        return (f"{what}: the sequence length ({seq}) is not divisible by the tensor group size ({parts}); "
                f"pad the sequence to a multiple of {parts} ({-(-seq // parts) * parts})")
    return None


def check_gathered_sequence(gathered: int, mine: int, parts: int, what: str) -> None:
    """Raise when the positions all-gathered along the sequence are not ``parts`` times this rank's own:
    the ranks of the group held different numbers of positions, and an uneven gather would be split
    back evenly (each rank getting others' positions). A rank holding the average alone cannot see it,
    but at least one rank of such a group raises (it ends the job: no rank goes on with wrong pieces)."""
    if gathered != mine * parts:
        raise ValueError(f"{what}: this rank holds {mine} sequence positions, but the tensor group's {parts} "
                         f"ranks hold {gathered} together: every rank of the group must hold the same number "
                         "(split the sequence with scatter_to_sequence, or pad it to a multiple of the group "
                         "size before splitting)")
