"""Why a measured leapfrog speedup falls short of its model, read off the two timelines.

The cost model assumes that every worker gets a core of its own. When the measurement comes in
far below the model, the two timelines of :func:`~parlearn.serial_chain.leapfrog.timeline`
(serial and leapfrog, same net) say which assumption broke:

* the chain steps run much *shorter* under leapfrog than in the serial schedule: the serial
  run was the one slowed while it was recorded, so the timelines cannot say why;
* the serial schedule's tasks are shorter than a hand-off to a thread (about 100 us):
  per-task overhead;
* the two timelines' own speedup (serial span over leapfrog span) is more than 2x away from
  the measured one: they were recorded apart from the timed repeats and the machine moved
  in between, so they cannot say why either;
* the chain steps, summed, run longer under leapfrog than in the serial schedule: the helper
  thread took the chain's core (no idle core). The sum, not the median step, so that a
  stretched tail or one long stall counts;
* the chain worker computed most weight gradients itself: the helper got little core time;
* otherwise the timelines do not say: the verdict says so instead of guessing.
"""

from __future__ import annotations

import os
from statistics import median

from parlearn.core.checks import check_float, check_int

__all__ = ["shortfall"]

_EVENTS = "a list of (lane, task, start_s, end_s) from leapfrog.timeline"
_CLOSE = 0.8        # measured at or above this share of the model: no explanation needed
_STRETCH = 1.5      # chain steps this much longer under leapfrog: their core was taken
_OWN = 0.5          # chain worker did more than this share of the weight gradients
_TINY = 100e-6      # a task shorter than this costs about what handing it to a thread does
_AGREE = 2.0        # timelines whose own speedup is this far from the measured one disagree


def _check_events(name: str, events) -> list:
    if not isinstance(events, list | tuple) or not events:
        raise ValueError(f"{name} must be {_EVENTS}, got {events!r:.80}")
    for e in events:
        if not (isinstance(e, tuple | list) and len(e) == 4 and isinstance(e[0], str)
                and isinstance(e[1], str) and all(isinstance(t, float | int)
                                                  and not isinstance(t, bool) for t in e[2:])
                and e[3] >= e[2]):
            raise ValueError(f"{name} must be {_EVENTS}; bad entry {e!r:.80}")
    if not any(e[1].startswith("chain") for e in events):
        raise ValueError(f"{name} holds no chain step (tasks named 'chain N'): "
                         f"not a leapfrog.timeline of a net with two or more layers")
    return list(events)


def _chain_time(events) -> float:
    return sum(e[3] - e[2] for e in events if e[1].startswith("chain"))


def _span(events) -> float:
    return max(e[3] for e in events) - min(e[2] for e in events)


def shortfall(serial_events: list, leapfrog_events: list, *, measured: float,
              modeled: float, workers: int, cores: int | None = None,
              load: float | None = None) -> dict:
    """Explain a measured leapfrog speedup against its ``modeled`` one from the timelines.

    Returns ``{"chain_stretch", "timeline_speedup", "chain_worker_share", "lanes", "cores",
    "load", "short", "why", "verdict"}``: the chain steps' summed time under leapfrog over the
    serial one; the serial timeline's span over the leapfrog one's; the share of
    weight gradients the chain's own lane computed; the lanes (of ``workers``) that did work;
    ``cores`` and the 1-minute ``load`` average (default: this machine's); whether
    ``measured`` is below 0.8 x ``modeled``; the reason in one sentence (``why``) and the
    same sentence after both numbers (``verdict``).
    """
    serial_events = _check_events("serial_events", serial_events)
    leapfrog_events = _check_events("leapfrog_events", leapfrog_events)
    measured = check_float("measured", measured, lo=0.0, lo_open=True)
    modeled = check_float("modeled", modeled, lo=0.0, lo_open=True)
    workers = check_int("workers", workers, lo=1)
    cores = (os.cpu_count() or 1) if cores is None else check_int("cores", cores, lo=1)
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    else:
        load = check_float("load", load, lo=0.0)
    stretch = _chain_time(leapfrog_events) / max(_chain_time(serial_events), 1e-12)
    timeline_speedup = _span(serial_events) / max(_span(leapfrog_events), 1e-12)
    agree = 1 / _AGREE <= measured / max(timeline_speedup, 1e-12) <= _AGREE
    chain_lane = next(e[0] for e in leapfrog_events if e[1].startswith("chain"))
    wgrads = [e for e in leapfrog_events if e[1].startswith("wgrad")]
    own = sum(e[0] == chain_lane for e in wgrads) / len(wgrads) if wgrads else 0.0
    lanes = len({e[0] for e in leapfrog_events})
    task = median(e[3] - e[2] for e in serial_events)
    short = measured < _CLOSE * modeled
    machine = f"{cores} cores, {workers} workers, load average {load:.1f}"
    if not short:
        why = (f"close to the model ({measured:.2f}x of {modeled:.2f}x): the second worker "
               f"found a free core ({machine})")
    elif stretch < 1 / _STRETCH:
        why = (f"these timelines cannot say ({machine}): the serial run's chain steps took "
               f"{1 / stretch:.1f}x as long as under leapfrog, so another program slowed the "
               f"serial run while it was recorded; rerun on a quieter machine")
    elif task < _TINY:
        why = (f"per-task overhead, not parallelism: a task of the serial schedule takes a "
               f"median {task * 1e6:.0f} us, about what handing it to another thread costs "
               f"({machine})")
    elif not agree:
        why = (f"these timelines cannot say ({machine}): they show a {timeline_speedup:.2f}x "
               f"speedup against {measured:.2f}x in the timed repeats, so the machine moved "
               f"between the two recordings; rerun on a quieter machine")
    elif stretch > _STRETCH:
        why = (f"no idle core on this machine ({machine}): under leapfrog the chain's steps "
               f"took {stretch:.1f}x as long in all as in the serial run, so the helper thread "
               f"ran on the chain's core instead of beside it")
    elif own > _OWN:
        why = (f"the helper got little core time ({machine}): the chain worker computed "
               f"{own:.0%} of the weight gradients itself")
    else:
        why = (f"not explained by these timelines ({machine}): the chain's steps took "
               f"{stretch:.1f}x as long as in the serial run, the helper computed "
               f"{1 - own:.0%} of the weight gradients "
               f"and a task takes a median {task * 1e6:.0f} us, well above a hand-off's cost")
    return {"chain_stretch": stretch, "timeline_speedup": timeline_speedup,
            "chain_worker_share": own, "lanes": lanes,
            "cores": cores, "load": load, "short": short, "why": why,
            "verdict": f"measured {measured:.2f}x, modeled {modeled:.2f}x: {why}"}
