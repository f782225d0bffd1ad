"""Import layering: the documented layer order, read from the source.

Data flows one way (README, "Layout"): train.py (and the other command lines, coat_jax.export,
coat_jax.sample and coat_jax.evaluate) -> coat_jax.training -> coat_jax.models ->
coat_jax.nn -> coat_jax.ops (and, beside them, the optimizer) -> coat_jax.kernels (the dispatch)
-> pallas_kernels/ or the numerics and jnp references; coat_jax.errors (the exit statuses)
below them all. Every module belongs to one layer of
LAYERS and imports only modules of its own layer or of layers below it; layers of one rank (the
ops and the optimizer; the references and the kernels) never import each other. No import cycle
inside a package; pallas_kernels imports only jax, numpy, the standard library (triton and
jax-triton in *_triton.py) and itself; within the dispatch, backends.py imports no family; no
module reaches into another module's private names.

Imports are read with ast (module level and function-local alike), so an import hidden in a
function is caught too.
"""
import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("coat_jax", "pallas_kernels")
# jax and numpy, plus the Triton language for the kernels written in it and launched through
# jax-triton (pallas_kernels/adam/*_triton.py): kernel languages, never coat_jax.
KERNEL_ALLOWED = {"jax", "jaxlib", "numpy", "pallas_kernels"}
TRITON_KERNEL_ALLOWED = KERNEL_ALLOWED | {"triton", "jax_triton"}


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules(package: str) -> dict[str, pathlib.Path]:
  if package == "train":
    return {"train": ROOT / "train.py"}
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


def _graph(package: str, targets: dict | None = None) -> dict[str, set[str]]:
  """Import edges from the package's modules to `targets`' modules (default: the package's own).
  Importing a.b.c also runs a and a.b."""
  mods = _modules(package)
  targets = mods if targets is None else targets
  graph = {}
  for name, path in mods.items():
    deps = set()
    for target in _imports(name, path):
      parts = target.split(".")
      for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in targets and prefix != name and not name.startswith(prefix + "."):
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


# (rank, layer, module prefixes), top to bottom. A module imports its own layer and lower ranks.
LAYERS = (
    (6, "cli", ("train", "coat_jax.export", "coat_jax.sample",   # command lines
                "coat_jax.evaluate")),
    (5, "training", ("coat_jax.training",)),
    (4, "models", ("coat_jax.models",)),
    (3, "nn", ("coat_jax.nn",)),
    (2, "ops", ("coat_jax.ops",)),
    (2, "optimizer", ("coat_jax.optim", "coat_jax.optim_state", "coat_jax.optim_config",
                      "coat_jax.optim_step")),
    (1, "dispatch", ("coat_jax.kernels",)),
    (0, "references", ("coat_jax.formats", "coat_jax.precision", "coat_jax.quantize",
                       "coat_jax.expansion", "coat_jax.gemm", "coat_jax.rounding",
                       "coat_jax.activations", "coat_jax.adam_math", "coat_jax.packed_state",
                       "coat_jax.memory")),
    (0, "kernels", ("pallas_kernels",)),
    (-1, "errors", ("coat_jax.errors",)),   # raised by every layer, imports nothing of coat_jax
)
FACADE = "coat_jax"   # the package's __init__: re-exports for users, in no layer


def _layer(module: str) -> tuple[int, str] | None:
  for rank, name, prefixes in LAYERS:
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return rank, name
  return None


def _all_modules() -> dict[str, pathlib.Path]:
  return {**_modules("train"), **_modules("coat_jax"), **_modules("pallas_kernels")}


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
  """'a (layer) imports b (layer)' for every edge that climbs or crosses to a sibling layer."""
  bad = []
  for src, deps in sorted(graph.items()):
    if src == FACADE:
      continue
    if _layer(src) is None:   # test_every_module_has_a_layer names it
      continue
    (rank, layer) = _layer(src)
    for dst in sorted(deps - {FACADE}):
      if _layer(dst) is None:
        continue
      dst_rank, dst_layer = _layer(dst)
      if dst_layer != layer and dst_rank >= rank:
        bad.append(f"{src} ({layer}) imports {dst} ({dst_layer})")
  return bad


def _full_graph() -> dict[str, set[str]]:
  targets = _all_modules()
  graph = {}
  for package in ("train",) + PACKAGES:
    graph.update(_graph(package, targets))
  return graph


def test_every_module_has_a_layer():
  assert not [m for m in _all_modules() if m != FACADE and _layer(m) is None]


def test_layer_check_catches_upward_and_sideways_imports():
  """A planted graph: ops importing models, the dispatch importing the optimizer and the optimizer
  importing ops are caught; downward imports are not."""
  graph = {"coat_jax.ops.linear_layer": {"coat_jax.models.llama", "coat_jax.kernels"},
           "coat_jax.kernels.adam": {"coat_jax.optim", "coat_jax.adam_math", "pallas_kernels"},
           "coat_jax.optim": {"coat_jax.ops"}, "coat_jax.quantize": {"pallas_kernels.gemm"},
           "train": {"coat_jax.training.loop", "coat_jax.models"}}
  assert _layer_violations(graph) == [
      "coat_jax.kernels.adam (dispatch) imports coat_jax.optim (optimizer)",
      "coat_jax.ops.linear_layer (ops) imports coat_jax.models.llama (models)",
      "coat_jax.optim (optimizer) imports coat_jax.ops (ops)",
      "coat_jax.quantize (references) imports pallas_kernels.gemm (kernels)"]


def test_imports_follow_the_layer_order():
  bad = _layer_violations(_full_graph())
  assert not bad, "imports against the layer order: " + "; ".join(bad)


def test_the_backend_module_imports_no_kernel_family():
  families = {"coat_jax.kernels.quantize", "coat_jax.kernels.gemm", "coat_jax.kernels.adam"}
  assert not _full_graph()["coat_jax.kernels.backends"] & families


def _private_reaches(name: str, path: pathlib.Path, modules) -> list[str]:
  """`from m import _x` and `m._x` (m an imported module of `modules`) in one module's source."""
  tree = ast.parse(path.read_text(), str(path))
  aliases, out = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name in modules and a.asname:
          aliases[a.asname] = a.name
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        if f"{node.module}.{a.name}" in modules:
          aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif a.name.startswith("_") and not a.name.startswith("__"):
          out.append(f"{name} imports {node.module}.{a.name}")
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      out.append(f"{name} uses {aliases[node.value.id]}.{node.attr}")
  return out


def test_no_module_reaches_into_another_modules_private_names(tmp_path):
  mods = _all_modules()
  planted = tmp_path / "m.py"
  planted.write_text("from coat_jax.kernels import backends\nfrom coat_jax.ops.x import _y\n"
                     "backends._warned.clear()\n")
  assert _private_reaches("m", planted, mods) == [
      "m imports coat_jax.ops.x._y", "m uses coat_jax.kernels.backends._warned"]
  bad = [hit for name, path in mods.items() for hit in _private_reaches(name, path, mods)]
  assert not bad, bad
