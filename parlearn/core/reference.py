"""GPU reference figures: bench rows measured on an accelerator, kept as labelled data.

Many methods of the course (batched copies, vmapped programs, batched environments) exist for
the throughput of an accelerator, and a 2-core CPU shows little of it. This module stores the
rows of ``python -m parlearn.bench --device cuda`` with the device, date and command that
produced them, so that a lesson can show them *beside* its own measurement, never mixed in::

    python -m parlearn.bench --device cuda --record     # what `make gpu-check` runs

    from parlearn.core import reference
    reference.show("dither")            # the recorded GPU rows for one bench, or why there are none

The file lives in the package (``parlearn/data/gpu_reference.json``). Only rows measured on
CUDA are accepted: a CPU run can never be recorded as a GPU figure.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from parlearn.core.bench import Row
from parlearn.core.checks import check_str

__all__ = ["REFERENCE_FILE", "Reference", "record", "load", "table", "show"]

#: Where ``make gpu-check`` stores the GPU figures, inside the installed package.
REFERENCE_FILE = Path(__file__).resolve().parent.parent / "data" / "gpu_reference.json"

_NONE_YET = ("No GPU reference figures are recorded in this copy of parlearn. On a machine "
             "with a CUDA GPU, `make gpu-check` measures every bench there and stores the "
             "rows, with the device, date and command, in {path}.")


@dataclass(frozen=True)
class Reference:
    """Rows measured on one GPU, with what produced them."""

    device: str          # the GPU and software, as parlearn.core.device.describe_str says
    date: str            # ISO date (UTC) of the run
    command: str         # the command that measured the rows
    rows: dict[str, tuple[Row, ...]]   # bench entry name (as in parlearn.bench.BENCHES) -> rows

    def rows_for(self, benchmark: str) -> list[Row]:
        """The rows of one bench entry (a name of ``parlearn.bench.BENCHES``)."""
        _text("benchmark", benchmark)
        return list(self.rows.get(benchmark, ()))


def _text(name: str, value) -> str:
    if not check_str(name, value).strip():
        raise ValueError(f"{name} must not be empty")
    return value


def _path(path) -> Path:
    if path is None:
        return REFERENCE_FILE
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or pathlib.Path, got {type(path).__name__}")
    return Path(path)


def record(rows: Mapping[str, Sequence[Row]], *, device: str, command: str, path=None,
           date: str | None = None) -> Path:
    """Write ``rows`` (bench entry name -> rows measured on CUDA) as the GPU figures.

    ``device`` names the GPU (``describe_str(torch.device('cuda'))``); ``command`` is what
    produced the rows. Returns the file written. Rows whose device is not CUDA are refused,
    as is a run with no rows.
    """
    _text("device", device)
    _text("command", command)
    if not isinstance(rows, Mapping):
        raise TypeError(f"rows must be a dict of bench name -> list of Row, "
                        f"got {type(rows).__name__}")
    flat = []
    for name, group in rows.items():
        _text("rows key", name)
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
            raise TypeError(f"rows[{name!r}] must be a list of Row, got {type(group).__name__}")
        bad = [r for r in group if not isinstance(r, Row)]
        if bad:
            raise TypeError(f"rows[{name!r}] must hold parlearn.bench Row objects, "
                            f"got {type(bad[0]).__name__}")
        flat += group
    if not flat:
        raise ValueError("rows must not be empty: nothing was measured")
    not_gpu = sorted({r.device for r in flat if not r.device.startswith("cuda")})
    if not_gpu:
        raise ValueError(f"rows: only rows measured on CUDA are GPU reference figures; "
                         f"got rows measured on {not_gpu}")
    if date is None:
        date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    _text("date", date)
    out = _path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "date": date, "command": command,
                               "rows": {name: [asdict(r) for r in group]
                                        for name, group in rows.items()}}, indent=1) + "\n")
    return out


def load(path=None) -> Reference | None:
    """The recorded GPU figures, or ``None`` when none were recorded."""
    src = _path(path)
    if not src.exists():
        return None
    data = json.loads(src.read_text())
    missing = {"device", "date", "command", "rows"} - set(data)
    if missing:
        raise ValueError(f"{src}: not a GPU reference file (missing {sorted(missing)})")
    names = {f.name for f in fields(Row)}
    rows = {name: tuple(Row(**{k: v for k, v in r.items() if k in names}) for r in group)
            for name, group in data["rows"].items()}
    return Reference(data["device"], data["date"], data["command"], rows)


def table(benchmark: str, *, path=None) -> str:
    """A Markdown table of one bench entry's GPU rows, with its label; or why there is none."""
    _text("benchmark", benchmark)
    ref = load(path)
    if ref is None:
        return _NONE_YET.format(path=_path(path))
    rows = ref.rows_for(benchmark)
    label = (f"**Measured on a GPU, not on this machine:** {ref.device}; {ref.date}; "
             f"`{ref.command}`.")
    if not rows:
        return label + f"\n\nThat run recorded no rows for `{benchmark}`."
    lines = [label, "", "| benchmark | baseline | variant | speedup (GPU) | detail |",
             "|---|---|---|---|---|"]
    lines += [f"| {r.benchmark} | {r.baseline} | {r.variant} | {r.ratio:.2f}x | {r.detail} |"
              for r in rows]
    return "\n".join(lines)


def show(benchmark: str, *, path=None) -> None:
    """Display :func:`table` (as Markdown in a notebook, as text elsewhere)."""
    text = table(benchmark, path=path)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)
