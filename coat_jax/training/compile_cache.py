"""JAX's persistent compilation cache for a run (`run.compile_cache`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import jax


def use_compile_cache(directory: str, say: Callable[[str], None]) -> None:
  """Points JAX's persistent compilation cache at `directory` (unless "" or one is already set),
  caching every program however fast it compiled (JAX's default leaves out those under 1 s, such
  as a run's initialisation and small helper programs, compiled again at every restart)."""
  if not directory or jax.config.jax_compilation_cache_dir:
    return
  path = Path(os.path.expanduser(directory))
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # a read-only home must not stop training
    say(f"[run] compilation cache off: cannot create {path} ({e})")
    return
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
