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


def test_hosts_and_hostfile_slots_add_up(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n")
    common = {"cpu_count": 64, "hosts": "a:1", "hostfile": str(hostfile)}
    assert "--oversubscribe" not in build(np=3, **common)
    assert "--oversubscribe" in build(np=4, **common)


def test_bare_host_counts_one_slot():
    assert parse_hosts("a,b:3") == [("a", 1), ("b", 3)]


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
        "UNISON_X",
    ]


def test_path_gets_venv_bin_once():
    command = build(environ={"PATH": "/venv/bin:/usr/bin"})
    assert option_values(command, "-x") == ["PATH=/venv/bin:/usr/bin"]
    assert option_values(build(environ={}), "-x") == ["PATH=/venv/bin"]


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


@pytest.mark.parametrize("hosts", ["localhost:2", "node-7.cluster.org:4,gpu_01:1", "10.0.0.7:2", "user@node1"])
def test_ordinary_host_names_are_accepted(hosts):
    assert option_values(build(hosts=hosts, cpu_count=64), "-H") == [hosts]


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
    with pytest.raises(MpirunNotFoundError, match=r"pip install 'unison\[mpi\]'"):
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
    ("--fusion-threshold-mb", "-1", "--fusion-threshold-mb -1 must be >= 0"),
    ("--cycle-time-ms", "0", "--cycle-time-ms 0 must be > 0"),
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


@pytest.mark.parametrize(
    ("stderr", "expected"),
    [
        (KILLED, "rank 1 (PID 8211 on vm) was killed by signal 9 (SIGKILL)"),
        (ABORTED, "rank 0 (on vm) called MPI_Abort with error code 1"),
        (NONZERO, "rank 1 exited with status 3"),
        (IMPROPER, "rank 1 (PID 6882 on vm) exited without calling MPI_Finalize"),
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
