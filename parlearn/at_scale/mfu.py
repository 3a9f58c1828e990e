"""MFU you can trust: a numerator and a denominator that say what they count, and an auditor.

Model FLOPs utilisation is ``tokens/s x model FLOPs per token / (devices x peak FLOP/s per
device)``. Both halves are easy to get wrong, and figures above 100% from a wrong one recur
in public training repositories. Here each half is stated:

**Numerator** (:func:`flop_count`), per token of a training step (forward + backward, a
multiply-add counted as 2):

- ``6 N`` for the ``N`` parameters that multiply activations in a matmul: every projection
  of attention and the MLP, and the output layer (2 FLOPs forward, 4 backward). Not the
  input embedding (a lookup), not the norms (elementwise): counting them is the commonest
  way to inflate MFU (Kaplan et al. 2020 count non-embedding parameters for this reason).
- attention's scores and weighted values: ``12 L d k`` for ``L`` layers of width ``d``
  (heads x head size) when each query meets ``k`` keys (``4 d k`` forward, 3x with
  backward). ``attention="full"`` takes ``k = s``, the PaLM paper's convention (Chowdhery et
  al. 2022, appendix B: ``6N + 12 L H Q T``), which counts the masked half of a causal
  model; ``"causal"`` counts only the keys a causal (and, with ``window``, a sliding-window)
  model attends to, ``k`` averaged over positions, the work a kernel that skips the masked
  blocks does (as FlashAttention's FLOP counts do). A figure must say which.
- *hardware* FLOPs add what recomputation repeats (``selective``: attention's scores and
  values again; ``full``: the whole forward again). They are what the device executes, but
  not model FLOPs: counting them in MFU rewards recomputing (Chowdhery et al. call the
  other figure HFU).

**Denominator** (:func:`peak_flops`): the device's *dense* peak for the step's dtype, per
device, from its datasheet (:data:`PEAKS`). Not the sparse figure NVIDIA's datasheets print
first, not the FP8 peak for a bf16 run, not a node's peak against one GPU's work, and never
another card's peak for a device not in the table.

:func:`audit` takes a claimed numerator and denominator and names each mistake it
recognises, with the factor it inflates MFU by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parlearn.core.checks import check_choice, check_float, check_int
from parlearn.multi_device.memory.calculator import PRESETS, LlamaShape

__all__ = ["PEAKS", "peak_flops", "FlopCount", "matmul_params", "flop_count", "utilisation",
           "Finding", "audit"]

ATTENTION = ("causal", "full")
RECOMPUTE = ("none", "selective", "full")

# Dense peak FLOP/s per device by dtype, from the vendors' datasheets (the tensor-core
# figures "with sparsity" are twice these; fp8 is listed for the auditor, not for bf16 runs).
PEAKS: dict[str, dict] = {
    "A100 SXM": {"bfloat16": 312e12, "float16": 312e12, "tfloat32": 156e12,
                 "float32": 19.5e12, "float64": 19.5e12,
                 "source": "NVIDIA A100 Tensor Core GPU datasheet (2021)"},
    "H100 SXM": {"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12,
                 "tfloat32": 494.5e12, "float32": 67e12, "float64": 67e12,
                 "source": "NVIDIA H100 Tensor Core GPU datasheet (2023)"},
    "H200 SXM": {"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12,
                 "tfloat32": 494.5e12, "float32": 67e12, "float64": 67e12,
                 "source": "NVIDIA H200 Tensor Core GPU datasheet (2024)"},
    "MI300X": {"bfloat16": 1307.4e12, "float16": 1307.4e12, "float8": 2614.9e12,
               "float32": 163.4e12, "float64": 81.7e12,
               "source": "AMD Instinct MI300X data sheet (2023)"},
}
SPARSE_FACTOR = 2.0   # "with sparsity" tensor-core figures: 2:4 structured sparsity


def peak_flops(device: str, dtype: str) -> float:
    """The dense peak FLOP/s of one ``device`` (a key of :data:`PEAKS`) for ``dtype``. An
    unknown device is refused: give its own datasheet's dense figure instead."""
    if not isinstance(device, str):
        raise TypeError(f"device must be a str naming a device, got {device!r}")
    if device not in PEAKS:
        raise ValueError(f"device {device!r} has no peak here (known: {sorted(PEAKS)}); use "
                         "its own datasheet's dense figure, never another card's")
    rates = {k: v for k, v in PEAKS[device].items() if k != "source"}
    return rates[check_choice("dtype", dtype, tuple(rates))]


def _shape(shape: LlamaShape | str) -> LlamaShape:
    if isinstance(shape, LlamaShape):
        return shape
    return PRESETS[check_choice("shape", shape, tuple(PRESETS))]


def _mean_keys(seq: int, attention: str, window: int | None) -> float:
    """Keys per query averaged over the ``seq`` positions."""
    if attention == "full":
        return float(seq if window is None else min(seq, window))
    w = seq if window is None else window
    # query i (0-based) sees keys max(0, i - w + 1) .. i: min(i + 1, w) of them
    full = min(seq, w)
    ramp = full * (full + 1) / 2            # positions 0 .. full-1 see 1 .. full keys
    return (ramp + (seq - full) * full) / seq


@dataclass(frozen=True)
class FlopCount:
    """FLOPs per token of one training step (module docstring): ``model`` (the MFU
    numerator) and ``hardware`` (with recomputation), from their parts."""

    matmul_params: int
    mean_keys: float
    attention: float
    model: float
    hardware: float
    convention: str

    def explain(self) -> str:
        return (f"model FLOPs/token = 6 x {self.matmul_params:,} matmul parameters + "
                f"{self.attention:,.0f} attention ({self.convention}, {self.mean_keys:,.1f} "
                f"keys per query) = {self.model:,.0f}; hardware FLOPs/token (with "
                f"recomputation) = {self.hardware:,.0f}")


def matmul_params(shape: LlamaShape | str) -> int:
    """Parameters that multiply activations: q, k, v, o, the SwiGLU MLP's three matrices per
    layer, and the output layer (tied or not). Not the input embedding, not the norms."""
    return _shape(shape).matmul_params()


def flop_count(shape: LlamaShape | str, seq: int, *, attention: str = "causal",
               window: int | None = None, recompute: str = "none") -> FlopCount:
    """FLOPs per token of a Llama-shaped model's training step at sequence length ``seq``
    (module docstring). ``shape``: a :class:`~parlearn.memory.LlamaShape` or a preset name."""
    m = _shape(shape)
    seq = check_int("seq", seq, lo=1)
    check_choice("attention", attention, ATTENTION)
    if window is not None:
        check_int("window", window, lo=1)
    check_choice("recompute", recompute, RECOMPUTE)
    n = matmul_params(m)
    k = _mean_keys(seq, attention, window)
    attn_fwd = 4 * m.layers * m.hidden * k
    model = 6 * n + 3 * attn_fwd
    extra = {"none": 0.0, "selective": attn_fwd, "full": 2 * n + attn_fwd}[recompute]
    return FlopCount(n, k, 3 * attn_fwd, model, model + extra,
                     attention + ("" if window is None else f", window {window}"))


def utilisation(tokens_per_second: float, count: FlopCount, *, device: str, dtype: str,
        n_devices: int) -> float:
    """``tokens_per_second x count.model / (n_devices x peak_flops(device, dtype))``: the
    whole job's tokens per second on ``n_devices`` devices."""
    check_float("tokens_per_second", tokens_per_second, lo=0)
    if not isinstance(count, FlopCount):
        raise TypeError(f"count must be a FlopCount (from flop_count), got {count!r}")
    n_devices = check_int("n_devices", n_devices, lo=1)
    return tokens_per_second * count.model / (n_devices * peak_flops(device, dtype))


@dataclass(frozen=True)
class Finding:
    """One mistake :func:`audit` recognised: which half (``kind``), what, and ``factor``,
    the claimed MFU over the trusted one (above 1: the mistake inflates MFU; NaN: no
    trusted peak to compare with)."""

    kind: str
    message: str
    factor: float


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6)


def audit(*, flops_per_token: float, peak_per_device: float, shape: LlamaShape | str,
          seq: int, device: str, dtype: str, attention: str = "causal",
          window: int | None = None, recompute: str = "none",
          devices_per_node: int = 8) -> list[Finding]:
    """Check a claimed MFU's numerator (``flops_per_token``) and denominator
    (``peak_per_device``) for a run of ``shape`` at ``seq`` in ``dtype`` on ``device``
    against the stated counts. Returns the mistakes recognised (empty: both halves are what
    this module counts); an unrecognised numerator is reported with its ratio."""
    claimed = check_float("flops_per_token", flops_per_token, lo=0, lo_open=True)
    peak = check_float("peak_per_device", peak_per_device, lo=0, lo_open=True)
    devices_per_node = check_int("devices_per_node", devices_per_node, lo=1)
    for name, v in (("device", device), ("dtype", dtype)):
        if not isinstance(v, str) or not v:
            raise TypeError(f"{name} must be a non-empty str, got {v!r}")
    if device in PEAKS:
        peak_flops(device, dtype)   # refuses a dtype the device has no peak for
    m = _shape(shape)
    right = flop_count(m, seq, attention=attention, window=window, recompute=recompute)
    out: list[Finding] = []

    def add(kind, message, factor):
        out.append(Finding(kind, message, factor))

    # -- numerator
    attn = right.attention
    norms = m.layers * 2 * m.hidden + m.hidden
    embedding = m.vocab * m.hidden
    wrong = {
        "all parameters in 6N": 6 * m.n_params() + attn,
        "input embedding in 6N": 6 * (right.matmul_params + embedding) + attn,
        "norm parameters in 6N": 6 * (right.matmul_params + norms) + attn,
    }
    if recompute != "none":
        wrong["recomputation counted as model FLOPs"] = right.hardware
    other = "full" if attention == "causal" else "causal"
    wrong[f"attention counted as {other}"] = flop_count(m, seq, attention=other,
                                                        window=window).model
    if window is not None and window < seq:
        wrong["sliding window ignored (every key counted)"] = flop_count(
            m, seq, attention=attention).model
    if not _close(claimed, right.model):
        hits = [k for k, v in wrong.items() if _close(claimed, v)]
        for k in hits:
            add("numerator", f"{k}: {claimed:,.0f} FLOPs/token where the model does "
                f"{right.model:,.0f}", claimed / right.model)
        if not hits:
            add("numerator", f"unrecognised count: {claimed:,.0f} FLOPs/token is "
                f"{claimed / right.model:.3f}x this module's {right.explain()}",
                claimed / right.model)

    # -- denominator
    if device not in PEAKS:
        borrowed = [d for d, rates in PEAKS.items() if _close(peak, rates.get(dtype, -1.0))]
        add("denominator", f"device {device!r} has no known peak"
            + (f", and {peak:.3g} FLOP/s is the {borrowed[0]}'s" if borrowed else "")
            + ": use the device's own datasheet figure", math.nan)
        return out
    dense = peak_flops(device, dtype)
    if _close(peak, dense):
        return out
    fp8 = PEAKS[device].get("float8")
    checks = {f"the sparse (2:4) peak, {SPARSE_FACTOR:g}x the dense one": SPARSE_FACTOR * dense,
              f"a node's peak ({devices_per_node} devices) against one device's work":
                  devices_per_node * dense}
    if fp8 is not None and dtype != "float8":
        checks[f"the FP8 peak for a {dtype} run"] = fp8
        checks["the sparse FP8 peak"] = SPARSE_FACTOR * fp8
    # Datasheets round (H100: 1,979 TFLOP/s "with sparsity", 2 x 989 dense), and one
    # printed figure can be two mistakes at once (H100's 1,979 is both the sparse bf16 and
    # the dense FP8 peak): match to the datasheet's rounding and name every reading.
    hits = [k for k, v in checks.items() if math.isclose(peak, v, rel_tol=1e-3)]
    if hits:
        both = (" (the datasheet prints one figure for both)" if len(hits) > 1 else "")
        add("denominator", f"{' or '.join(hits)}{both}: {peak:.4g} FLOP/s instead of "
            f"{dense:.4g}", dense / peak)
    if not hits:
        add("denominator", f"unrecognised peak: {peak:.4g} FLOP/s where {device}'s dense "
            f"{dtype} peak is {dense:.4g} ({PEAKS[device]['source']})", dense / peak)
    return out
