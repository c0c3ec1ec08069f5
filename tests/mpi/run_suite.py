"""Entry point for a rank: run one pytest file, write this rank's JUnit XML.

Usage (on every rank): ``python tests/mpi/run_suite.py OUTDIR SUITE.py [pytest args]``.
A rank whose tests fail stops early with ``-x``; it then aborts the MPI job so
the other ranks are not left waiting inside a collective. A rank still running
after ``TEST_HANG_DUMP_S`` seconds (200) prints every thread's stack and
exits, so a hang shows where it hangs.
"""

import faulthandler
import os
import sys

import pytest

if __name__ == "__main__":
    outdir, suite, *rest = sys.argv[1:]
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    # a hung rank prints every thread's stack and exits before the harness's timeout
    # (to a duplicate of stderr: pytest captures file descriptor 2 while tests run)
    dump = os.fdopen(os.dup(2), "w")
    faulthandler.dump_traceback_later(float(os.environ.get("TEST_HANG_DUMP_S", "200")), exit=True,
                                      file=dump)
    rc = int(pytest.main(["-q", "-p", "no:cacheprovider", "-x", "--color=no",
                          f"--junitxml={outdir}/junit-rank-{rank}.xml", suite, *rest]))
    if rc != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(rc)
    sys.exit(rc)
