"""Train the Flax Llama end to end: the command line over coat_jax.training.

Usage (`coat-train` once the package is installed; `python train.py` in the repository):
  coat-train                                        # the embedded default: the shipped `tiny`
  coat-train --config llama-125m --set optimizer.name=coat_adamw --set precision=coat
  coat-train --config configs/tiny.yaml --resume    # continue the identical run
  coat-train --steps 1000 --out-dir runs/x          # shorthands for --set run.steps/run.out_dir
  coat-train --distributed ...                      # multi-host: jax.distributed.initialize()

`--config` takes a YAML file, or the name of a shipped config (tiny, llama-125m, olmo-1b,
llama2-7b, llama2-7b-sft, llama2-13b), which an installed package carries. Everything a run needs
is in the config (coat_jax/training/schema.py documents the schema); `--set section.key=value`
overrides any entry and is checked like the file. Outputs go to `run.out_dir`: config.yaml,
metrics.jsonl, tb/ (TensorBoard), loss.png, summary.json, checkpoints/.

SIGINT/SIGTERM: the current step finishes, a checkpoint is written, and the run exits with status
128 + the signal number (130, 143; `--resume` continues it); a second signal stops at once. A fresh
run into a directory that holds an earlier run is refused: --resume, a new --out-dir or --overwrite.
Errors print one line (`error: ...`; `--debug` adds the traceback) and exit with the status
coat_jax/errors.py lists: 2 bad input, 3 diverged, 4 out of memory, 5 storage.
"""
from __future__ import annotations

import argparse
import signal
import sys
import traceback
from pathlib import Path

from coat_jax import errors
from coat_jax.training import schema
from coat_jax.training.loop import exit_status, run
from coat_jax.training.schema import RunConfig

# The shipped run configs: package data of coat_jax (in the repository, a link to configs/).
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = "tiny"


def shipped_configs() -> list[str]:
  """The names of the shipped run configs, for `--config NAME`."""
  return sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def config_path(name: str) -> Path:
  """The YAML file `--config name` means: a file that exists, else the shipped config of that name
  (`llama2-7b`, `llama2-7b.yaml` or `configs/llama2-7b.yaml`, from any directory)."""
  path = Path(name).expanduser()
  if path.is_file():
    return path
  if path.parent in (Path("."), Path("configs")):
    shipped = CONFIGS / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if shipped.is_file():
      return shipped
  raise errors.BadInputError(f"config file not found: {name} (a YAML file, or a shipped config: "
                             f"{', '.join(shipped_configs())})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=None,
                 help=f"YAML run config, or a shipped config's name: {', '.join(shipped_configs())} "
                      f"(default: the embedded {DEFAULT_CONFIG})")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config entry, e.g. --set optimizer.lr=1e-3 (repeatable)")
  p.add_argument("--resume", action="store_true", help="restore the newest intact checkpoint and continue")
  p.add_argument("--resume-from", type=int, default=None, metavar="STEP",
                 help="like --resume, from the checkpoint at STEP")
  p.add_argument("--overwrite", action="store_true",
                 help="start afresh in an output directory that holds an earlier run, deleting its "
                      "checkpoints and logs (without it such a run is refused; a directory that "
                      "holds other files too is never cleared)")
  p.add_argument("--allow-steps-change", action="store_true",
                 help="resume with a run.steps other than the checkpoint's (the learning-rate "
                      "schedule is recomputed for the new length; without it that is refused)")
  p.add_argument("--steps", type=int, default=None, help="shorthand for --set run.steps=N")
  p.add_argument("--out-dir", default=None, help="shorthand for --set run.out_dir=DIR")
  p.add_argument("--stop-after", type=int, default=None,
                 help="stop (with a checkpoint) once this many steps are done, keeping the schedule "
                      "of run.steps: the second half comes with --resume")
  p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
  p.add_argument("--distributed", action="store_true",
                 help="multi-host: call jax.distributed.initialize() first (coordinator from the "
                      "environment: SLURM/TPU/Open MPI, or JAX_COORDINATOR_ADDRESS etc.)")
  p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
  p.add_argument("--plan", action="store_true",
                 help="compile the step on abstract shapes, print its predicted memory per device "
                      "and the settings that fit (remat, microbatches, master weights, batch), "
                      "and exit without training")
  p.add_argument("--debug", action="store_true", help="show the traceback of an error")
  return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> RunConfig:
  overrides = list(args.overrides)
  if args.steps is not None:
    overrides.append(f"run.steps={args.steps}")
  if args.out_dir is not None:  # the path as given: no YAML reading of '#', numbers or quotes
    overrides.append(("run.out_dir", args.out_dir))
  if args.no_progress:
    overrides.append("run.progress=false")
  return schema.load(config_path(args.config or DEFAULT_CONFIG), overrides)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  if args.distributed:
    import jax
    jax.distributed.initialize()
  cfg = load_config(args)
  if args.print_config:
    print(cfg.to_yaml(), end="")
    return {}
  if args.plan:
    from coat_jax.training.plan import show
    print(show(cfg))
    return {}
  return run(cfg, resume=args.resume, stop_after=args.stop_after, overwrite=args.overwrite,
             resume_from=args.resume_from, allow_steps_change=args.allow_steps_change)


def error_status(e: BaseException) -> tuple[int, str]:
  """(exit status, one-line message) for an error that ends the run (errors.py's statuses)."""
  if isinstance(e, errors.RunError):
    status = e.exit_code
  elif isinstance(e, ValueError):
    status = errors.EXIT_BAD_INPUT
  elif isinstance(e, OSError):  # disk full, read-only, permission, a directory gone
    status = errors.EXIT_STORAGE
    if e.strerror and e.filename:
      e = f"{e.filename}: {e.strerror}"
  else:  # KeyboardInterrupt: a second signal stopped the run at once, without a checkpoint
    signum = getattr(e, "signum", signal.SIGINT)
    return 128 + int(signum), f"stopped by a second {signal.Signals(signum).name} (no checkpoint)"
  return status, " ".join(str(e).split()) or type(e).__name__


def entry_point(argv: list[str] | None = None) -> None:
  """`coat-train` and `python train.py`: main(), an error as one line, the run's exit status."""
  argv = sys.argv[1:] if argv is None else argv
  try:
    summary = main(argv)
  except (errors.RunError, ValueError, OSError, KeyboardInterrupt) as e:
    status, message = error_status(e)
    if "--debug" in argv:
      traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)
  sys.exit(exit_status(summary))  # 128 + N after signal N (checkpoint written), else 0
