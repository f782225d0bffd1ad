"""Train the Flax Llama end to end: the command line over coat_jax.training.

  python train.py                                   # the embedded default: configs/tiny.yaml
  python train.py --config configs/llama-125m.yaml --set optimizer.name=coat_adamw --set precision=coat
  python train.py --config configs/tiny.yaml --resume        # continue the identical run
  python train.py --help                                     # every option

The same command line is `coat-train` once the package is installed; both run
coat_jax/training/cli.py, which documents the options, the exit statuses and the signals.
"""
from coat_jax.training.cli import entry_point, error_status, load_config, main, parse_args  # noqa: F401

if __name__ == "__main__":
  entry_point()
