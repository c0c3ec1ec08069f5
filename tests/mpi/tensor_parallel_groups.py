"""What the torch and Keras tensor-parallel rank suites share: the groups and the bad-size cases.

Both suites cut the job into consecutive groups of tp ranks for tp = 1..4 (at np 4: {0} {1} {2}
{3}; {0,1} {2,3}; {0,1,2} with rank 3 idle; {0,1,2,3}), registered on every rank in the same
order, and check the same size errors; ``hvd`` is the backend module (both export the same names).
"""

from __future__ import annotations

from typing import Any

import pytest
from mpi4py import MPI

N, R = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
TPS = [tp for tp in (1, 2, 3, 4) if tp <= N]


def register_groups(hvd: Any) -> dict[int, Any]:
    """tp -> this rank's registered group (None where this rank is idle at that tp)."""
    sets: dict[int, Any] = {}
    for tp in TPS:
        sets[tp] = None
        for first in range(0, N - N % tp, tp):
            ps = hvd.add_process_set(hvd.ProcessSet(range(first, first + tp)))
            if R in ps.ranks:
                sets[tp] = ps
    return sets


def group_or_refusal(hvd: Any, sets: dict[int, Any], tp: int) -> Any:
    """This rank's group at ``tp``; on an idle rank, check that joining another group is refused."""
    ps = sets[tp]
    if ps is None:
        with pytest.raises(ValueError, match="not in the tensor group"):
            hvd.ColumnParallelLinear(4, 4 * tp, process_set=hvd.ProcessSet(range(tp)))
    return ps


#: (builder(hvd, tp, ps), the size named in the error)
BAD_SIZES = [
    (lambda hvd, tp, ps: hvd.ColumnParallelLinear(4, 2 * tp + 1, process_set=ps), "out_features"),
    (lambda hvd, tp, ps: hvd.RowParallelLinear(2 * tp + 1, 4, process_set=ps), "in_features"),
    (lambda hvd, tp, ps: hvd.VocabParallelEmbedding(5 * tp + 1, 4, process_set=ps), "num_embeddings"),
    (lambda hvd, tp, ps: hvd.ParallelSelfAttention(2 * (tp + 1), tp + 1, process_set=ps), "num_heads"),
    (lambda hvd, tp, ps: hvd.ParallelMLP(4, 3 * tp + 1, process_set=ps), "out_features"),
]
BAD_SIZE_IDS = ["column", "row", "vocab", "heads", "mlp"]


def check_bad_size(hvd: Any, sets: dict[int, Any], tp: int, build: Any, what: str) -> None:
    """Building with a size not divisible by ``tp`` raises the ValueError that says how to pad."""
    ps = group_or_refusal(hvd, sets, tp)
    if ps is None:
        return
    with pytest.raises(ValueError, match=rf"{what} \(\d+\) is not divisible by the tensor group size \({tp}\).*"
                                         rf"[Pp]ad .* to a multiple of {tp}"):
        build(hvd, tp, ps)
