"""What a run's exit status means, and the errors that carry it.

Every way a run can end has its own exit status, so a scheduler can tell them apart:

| status | meaning | what is on disk |
|---|---|---|
| 0 | finished (or `--plan` / `--print-config` printed what was asked) | the final checkpoint |
| 2 | bad input: command line, config, data, a model directory, an output directory in use | nothing was changed |
| 3 | diverged: a non-finite loss or gradient norm (policy `run.on_nonfinite`) | the last good checkpoint |
| 4 | out of device memory, predicted before the first step or met during one | the last good checkpoint |
| 5 | storage: the disk is full, a directory is read-only, a file cannot be written | the last good checkpoint |
| 128 + N | stopped by signal N (130 SIGINT, 143 SIGTERM) after saving a checkpoint | a checkpoint of that step |

Each error prints one line on stderr (`error: ...`); `--debug` shows the traceback too.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_OUT_OF_MEMORY = 4
EXIT_STORAGE = 5


class RunError(Exception):
  """An error that ends a run with one line on stderr and `exit_code` as its status."""
  exit_code = EXIT_BAD_INPUT


class BadInputError(RunError, ValueError):
  """The command line, config, data or a directory given is unusable (status 2)."""
  exit_code = EXIT_BAD_INPUT


class DivergedError(RunError):
  """The loss or the gradient norm became non-finite (status 3)."""
  exit_code = EXIT_DIVERGED


class OutOfMemoryError(RunError):
  """The step needs more device memory than the device has (status 4)."""
  exit_code = EXIT_OUT_OF_MEMORY


class StorageError(RunError):
  """Writing the run's files failed: disk full, read-only, missing directory (status 5)."""
  exit_code = EXIT_STORAGE
