"""Pick a device, describe the machine, and configure fake JAX CPU devices.

Nothing here needs CUDA or JAX to import. JAX is only imported when asked for,
so a lesson can still configure fake devices after ``import parlearn``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Iterator
from importlib import metadata

import torch

from parlearn.core.checks import check_device, check_int

__all__ = ["pick_device", "describe", "describe_str", "fake_jax_cpu_devices", "sync", "threads",
           "THREAD_POLICY"]

_KNOWN = ("cuda", "mps", "cpu")


def _available(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
    return kind == "cpu"


def pick_device(prefer: str | torch.device | None = None) -> torch.device:
    """The device to compute on.

    With ``prefer=None``: ``cuda`` if available, else ``mps``, else ``cpu``.
    With ``prefer`` given ("cpu", "cuda", "cuda:1", "mps" or a ``torch.device``),
    that device, or a ``ValueError`` saying it is not available here.
    """
    return _pick(prefer, "prefer")


def _pick(prefer: str | torch.device | None, name: str) -> torch.device:
    if prefer is None:
        return torch.device(next(k for k in _KNOWN if _available(k)))
    try:
        dev = torch.device(prefer)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{name}={prefer!r} is not a device; use one of {_KNOWN}") from err
    if dev.type not in _KNOWN:
        raise ValueError(f"{name}={prefer!r}: device type must be one of {_KNOWN}")
    if not _available(dev.type):
        raise ValueError(f"{name}={prefer!r}: {dev.type} is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"{name}={prefer!r}: only {torch.cuda.device_count()} CUDA device(s) here"
        )
    return dev


THREAD_POLICY = """\
parlearn's thread policy for measurements:
- The library never changes torch's global intra-op thread count for longer than one call.
  Where a measurement needs a fixed count (the bench, a lesson's explorer) it runs inside
  ``with threads(n):``, which restores the caller's count afterwards, also after errors.
- Every timing records the thread count it ran with (``Timing.threads``).
- Lessons and the bench pin ONE intra-op thread per worker by default: with torch's default
  of one thread per core, anything else running on the machine makes every op 10-30x slower
  and ratios flip. With one thread the figures stay readable on a busy laptop.
"""


def threads(n: int) -> contextlib.AbstractContextManager[int]:
    """Run the block with ``n`` torch intra-op threads, then restore the caller's count.

    >>> with threads(1):
    ...     pass  # measure here

    ``n`` is checked when called, before the ``with`` block is entered.
    """
    return _threads(check_int("n (threads)", n, lo=1))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def sync(device: torch.device | str) -> None:
    """Wait for queued kernels on ``device`` (a no-op on CPU)."""
    dev = check_device("device", device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def describe(device: str | torch.device | None = None) -> dict:
    """A short description of this machine and the device parlearn would use.

    Keys: ``device``, ``cpu``, ``cores``, ``torch_threads``, ``python``, ``torch``,
    ``jax`` (installed version or None; JAX is not started), and for CUDA
    ``gpu`` and ``gpu_memory_gib``.
    """
    dev = _pick(device, "device")
    info = {
        "device": str(dev),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "jax": _version("jax"),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


def describe_str(device: str | torch.device | None = None) -> str:
    """:func:`describe` as one readable line."""
    d = describe(device)
    line = (
        f"device={d['device']} | {d['cores']} cores, torch threads={d['torch_threads']} | "
        f"python {d['python']}, torch {d['torch']}, jax {d['jax'] or 'not installed'}"
    )
    if "gpu" in d:
        line += f" | GPU: {d['gpu']} ({d['gpu_memory_gib']} GiB)"
    return line


def _jax_backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    # Older JAX has no query: assume the worst once JAX is imported.
    return True if started is None else bool(started())


def fake_jax_cpu_devices(n: int) -> None:
    """Make JAX expose ``n`` real XLA CPU devices (they share this machine's cores).

    Must run before JAX starts its backends (before the first ``jax.devices()`` or
    computation); afterwards the device count is fixed, and this raises
    ``RuntimeError`` rather than silently leaving the old count in place.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if _jax_backends_started():
        import jax

        have = jax.local_device_count(backend="cpu")
        if have == n:
            return
        raise RuntimeError(
            f"JAX already started with {have} CPU device(s); fake_jax_cpu_devices({n}) must run "
            "before the first JAX computation. Restart the kernel and call it first."
        )
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_num_cpu_devices", n)
