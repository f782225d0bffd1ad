"""Reading a jax.profiler trace: GPU kernel intervals, the idle gaps between them, and what the
host was doing during each gap.

A gap is time inside the traced window (first kernel start to last kernel end, per GPU) when no
kernel runs on any of the GPU's streams. For each of the largest gaps the kernels before and after
it are named, and the host events (CUDA driver/runtime calls, XLA thunks, Python) that overlap it,
by overlapped time: a gap filled by a host call (a launch, a memcpy, a synchronize) is the host's;
a gap with no host activity is the GPU waiting on itself (e.g. a dependency across streams).
"""
from __future__ import annotations

import collections
from typing import NamedTuple

from benchmarks._common import gpu_kernel_events


class Gap(NamedTuple):
  start_ns: int
  us: float
  before: str
  after: str
  host: list  # [(host event name, overlapped us)], the shortest (innermost) events first


def _stat(ev, key: str) -> str:
  for k, v in ev.stats:
    if str(k) == key:
      return str(v)
  return ""


def kernel_intervals(data) -> dict[str, list[tuple[int, int, str]]]:
  """{GPU plane name: [(start ns, end ns, "kernel [hlo_op]")] sorted by start} of a read trace."""
  out = collections.defaultdict(list)
  for plane, ev in gpu_kernel_events(data):
    op = _stat(ev, "hlo_op")
    out[plane].append((ev.start_ns, ev.start_ns + ev.duration_ns,
                       f"{ev.name} [{op}]" if op else ev.name))
  return {plane: sorted(evs) for plane, evs in out.items()}


def host_events(data) -> list[tuple[int, int, str]]:
  """(start ns, end ns, name) of every host-plane event (all threads)."""
  out = []
  for plane in data.planes:
    if plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      for ev in line.events:
        out.append((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name))
  return sorted(out)


def idle_gaps(kernels: list[tuple[int, int, str]], host: list[tuple[int, int, str]] = (),
              min_us: float = 0.0, explain: int = 20) -> tuple[float, float, list[Gap]]:
  """(busy us, span us, gaps of at least min_us, largest first) of one GPU's kernel intervals;
  the host events overlapping each of the `explain` largest gaps are looked up."""
  gaps, busy = [], 0.0
  cur_start, cur_end, cur_last = kernels[0][0], kernels[0][1], kernels[0][2]
  for start, end, name in kernels[1:]:
    if start > cur_end:
      busy += cur_end - cur_start
      if (start - cur_end) / 1e3 >= min_us:
        gaps.append((cur_end, start, cur_last, name))
      cur_start, cur_end, cur_last = start, end, name
    elif end > cur_end:
      cur_end, cur_last = end, name
  busy += cur_end - cur_start
  span = max(e for _, e, _ in kernels) - kernels[0][0]
  out = []
  for rank, (g0, g1, before, after) in enumerate(sorted(gaps, key=lambda g: g[0] - g[1])):
    if rank >= explain:
      out.append(Gap(g0, (g1 - g0) / 1e3, before, after, []))
      continue
    overlap, length = collections.Counter(), {}
    for h0, h1, name in host:
      if h0 >= g1:
        break
      if h1 > g0:
        overlap[name] += (min(h1, g1) - max(h0, g0)) / 1e3
        length[name] = min(length.get(name, h1 - h0), h1 - h0)
    inner = sorted(overlap, key=lambda n: length[n])[:5]  # innermost (shortest) events first
    out.append(Gap(g0, (g1 - g0) / 1e3, before, after, [(n, overlap[n]) for n in inner]))
  return busy / 1e3, span / 1e3, out


def gap_report(data, top: int = 12, min_us: float = 2.0) -> dict:
  """{"busy_ms", "span_ms", "idle_ms", "gaps": count >= min_us, "idle_by_size": {bucket: ms},
  "top": [[us, before, after, host overlap]]} for the first GPU of a read trace
  (`_common.load_trace`)."""
  planes = kernel_intervals(data)
  if not planes:
    return {}
  kernels = planes[sorted(planes)[0]]
  busy_us, span_us, gaps = idle_gaps(kernels, host_events(data), min_us=0.0, explain=top)
  busy, span = busy_us / 1e3, span_us / 1e3
  buckets = collections.Counter()
  for g in gaps:
    key = ("< 5 us" if g.us < 5 else "5-20 us" if g.us < 20 else "20-100 us" if g.us < 100
           else ">= 100 us")
    buckets[key] += g.us / 1e3
  return {"busy_ms": busy, "span_ms": span, "idle_ms": span - busy, "kernels": len(kernels),
          "gaps": sum(g.us >= min_us for g in gaps), "idle_by_size": dict(buckets),
          "top": [[round(g.us, 1), g.before[:90], g.after[:90],
                   [(n[:60], round(us, 1)) for n, us in g.host]] for g in gaps[:top]]}


def print_gap_report(rep: dict, label: str, per: int = 1) -> None:
  """Prints a gap_report; times divided by `per` (e.g. the traced steps)."""
  if not rep:
    print(f"{label}: no GPU kernels in the trace")
    return
  print(f"\n{label}: {rep['busy_ms'] / per:.2f} ms busy, {rep['idle_ms'] / per:.2f} ms idle of "
        f"{rep['span_ms'] / per:.2f} ms span per call ({rep['kernels'] // per} kernels); idle by gap "
        f"size (ms per call): " + ", ".join(f"{k} {v / per:.2f}" for k, v in
                                             sorted(rep["idle_by_size"].items())))
  for us, before, after, host in rep["top"]:
    what = "; ".join(f"{n} {t:.0f} us" for n, t in host) or "no host event"
    print(f"  gap {us:8.1f} us  after {before[:60]}\n{'':20}before {after[:60]}\n{'':20}host: {what}")
