"""``unisonrun``, the job launcher: builds and runs the ``mpirun`` command for a Unison job."""

from unison.run.launcher import LaunchConfig, MpirunNotFoundError, build_command, find_mpirun, main

__all__ = ["LaunchConfig", "MpirunNotFoundError", "build_command", "find_mpirun", "main"]
