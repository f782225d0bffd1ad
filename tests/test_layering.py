"""Import layering: no import cycle inside coat_jax; pallas_kernels imports only jax, numpy, the
standard library and its own modules (never coat_jax).

Imports are read from the source with ast (module level and function-local alike), so a cycle
hidden behind a local import is caught too.
"""
import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("coat_jax", "pallas_kernels")
# jax and numpy, plus the Triton language for the kernels written in it and launched through
# jax-triton (pallas_kernels/*_triton.py, issue 14): kernel languages, never coat_jax.
KERNEL_ALLOWED = {"jax", "jaxlib", "numpy", "pallas_kernels"}
TRITON_KERNEL_ALLOWED = KERNEL_ALLOWED | {"triton", "jax_triton"}


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules(package: str) -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str, path: pathlib.Path) -> set[str]:
  """Absolute names of every module `name` imports (relative imports resolved); for
  `from pkg import x` both pkg and pkg.x (x may be a submodule)."""
  tree = ast.parse(path.read_text(), str(path))
  is_pkg = path.name == "__init__.py"
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".")
        base = base[:len(base) - node.level + (1 if is_pkg else 0)]
        mod = ".".join(base + ([node.module] if node.module else []))
      else:
        mod = node.module
      out.add(mod)
      out.update(f"{mod}.{alias.name}" for alias in node.names)
  return out


def _graph(package: str) -> dict[str, set[str]]:
  """Import edges between the package's own modules. Importing a.b.c also runs a and a.b."""
  mods = _modules(package)
  graph = {}
  for name, path in mods.items():
    deps = set()
    for target in _imports(name, path):
      parts = target.split(".")
      for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in mods and prefix != name and not name.startswith(prefix + "."):
          deps.add(prefix)
    graph[name] = deps
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_cycle_finder_finds_a_planted_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve(tmp_path):
  pkg = tmp_path / "coat_jax" / "sub"
  pkg.mkdir(parents=True)
  f = pkg / "mod.py"
  f.write_text("from . import other\nfrom ..top import x\ndef g():\n  import numpy\n")
  got = _imports("coat_jax.sub.mod", f)
  assert {"coat_jax.sub", "coat_jax.sub.other", "coat_jax.top", "coat_jax.top.x",
          "numpy"} <= got


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
  cycles = _cycles(_graph(package))
  assert not cycles, f"import cycles in {package}: {cycles}"


def test_pallas_kernels_import_only_jax_numpy_stdlib_and_themselves():
  bad = []
  for name, path in _modules("pallas_kernels").items():
    for target in _imports(name, path):
      top = target.split(".")[0]
      allowed = TRITON_KERNEL_ALLOWED if name.endswith("_triton") else KERNEL_ALLOWED
      if top in allowed or top in sys.stdlib_module_names or top == "__future__":
        continue
      bad.append(f"{name} imports {target}")
  assert not bad, "pallas_kernels must import only jax, numpy and the stdlib: " + "; ".join(bad)


def test_dispatch_imports_downward_only():
  """coat_jax.kernels (the dispatch) never imports the optimizer, ops, modules or models above it."""
  above = ("coat_jax.optim", "coat_jax.ops", "coat_jax.nn", "coat_jax.models", "coat_jax.train")
  deps = _graph("coat_jax")["coat_jax.kernels"]
  assert not [d for d in deps if d.startswith(above)], deps
