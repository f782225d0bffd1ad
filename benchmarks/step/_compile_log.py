"""What XLA says about a compile: statistics of the optimized HLO text and per-pass times from
XLA's own log (compile_breakdown.py's child writes both; its parent reads the log)."""
from __future__ import annotations

import collections
import re
import sys

from benchmarks._hlo import top_level

PHASE_TAG = "COMPILE_BREAKDOWN_PHASE "
# custom_call_target -> column; XLA's own Triton fusions are counted from fusion backend configs.
TARGETS = (("mosaic", ("mosaic_gpu",)), ("jax-triton", ("triton_kernel_call",)),
           ("pallas-triton", ("__gpu$xla.gpu.triton",)), ("cudnn", ("__cudnn",)),
           ("cublas", ("__cublas",)))


def hlo_stats(text: str) -> dict:
  """Instruction and kernel counts of optimized HLO text, custom calls by target."""
  comps, launched = top_level(text)
  kernels, targets = 0, collections.Counter()
  for _, opcode, _, line in launched:
    if opcode in ("while", "call", "conditional"):
      continue
    kernels += 1
    if opcode == "custom-call":
      m = re.search(r'custom_call_target="([^"]*)"', line)
      name = m.group(1) if m else "?"
      col = next((c for c, prefixes in TARGETS if name.startswith(prefixes)), "other")
      targets[col] += 1
      if col == "other":
        targets[f"other:{name}"] += 1
  triton_kinds = collections.Counter(re.findall(r'"kind":"(__triton\w*)"', text))
  targets["xla-triton fusions"] = sum(triton_kinds.values())
  ops = collections.Counter(op for body in comps.values() for _, op, _, _ in body)
  return dict(instructions=sum(len(b) for b in comps.values()), computations=len(comps),
              kernels=kernels, custom_calls=dict(targets), opt_barriers=ops["opt-barrier"],
              while_loops=ops["while"], fusions=ops["fusion"],
              xla_triton_kinds=dict(triton_kinds))


def phase(name: str) -> None:
  """Marks a phase in stderr, where XLA logs: the parent attributes log lines to phases. One write
  (print's text and newline are two), though XLA's threads may still put it inside a line of
  theirs: parse_log finds the tag anywhere in a line."""
  sys.stderr.write(f"{PHASE_TAG}{name}\n")
  sys.stderr.flush()


_PHASE = re.compile(re.escape(PHASE_TAG) + r"(\w+)")
_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+(\d+) ([\w.\-]+):\d+\] (.*)$")
_TIME = re.compile(r"^(.*?) time: ([0-9.e+\-]+) (us|ms|s|min|h)\b")
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


def parse_log(lines, module_prefix: str = "jit_train_step", phases=("compile",)) -> dict:
  """Pass times of the modules named module_prefix* from XLA's log lines, within `phases`.

  Returns {passes: {name: seconds}, pipelines: {name: seconds}, timers: {label: seconds},
  other_modules: {module: passes seconds} (autotuning and prewarm sub-compiles), slow: [alarm
  lines]}. A pass's module is the last "Running HLO pass pipeline on module M: P" of its thread;
  a "pass" named like a pipeline (a nested pipeline) is a container, kept apart in `pipelines`.
  """
  current, pipelines = {}, set()
  raw = []   # (module, name, seconds)
  timers, slow = collections.Counter(), []
  cur_phase = None
  for line in lines:
    tagged = _PHASE.search(line)
    if tagged:
      cur_phase = tagged.group(1)
      continue
    if "slow compile" in line.lower() or "taking >" in line:
      slow.append(line.strip()[:300])
    m = _LOG.match(line)
    if not m or cur_phase not in phases:
      continue
    tid, _, msg = m.groups()
    if msg.startswith("Running HLO pass pipeline on module "):
      mod, _, pipe = msg[len("Running HLO pass pipeline on module "):].partition(": ")
      current[tid] = mod
      pipelines.add(pipe.strip())
      continue
    t = _TIME.match(msg)
    if not t:
      continue
    label, secs = t.group(1), float(t.group(2)) * _UNIT[t.group(3)]
    if label.startswith("HLO pass: "):
      raw.append((current.get(tid, "?"), label[len("HLO pass: "):], secs))
    else:
      timers[re.sub(r" for \S+$", "", label)] += secs
  passes, pipes, others = collections.Counter(), collections.Counter(), collections.Counter()
  for mod, name, secs in raw:
    if not mod.startswith(module_prefix):
      others[mod] += secs
    elif name in pipelines:
      pipes[name] += secs
    else:
      passes[name] += secs
  return dict(passes=dict(passes), pipelines=dict(pipes), timers=dict(timers),
              other_modules=dict(others), slow=slow[:20])
