"""The dashboard pattern every lesson uses.

A dashboard is three things:

* ``compute(**params) -> result``: pure, no plotting, testable on its own;
* ``plot(result, ax)``: draws a result on a matplotlib axis (or array of axes);
* controls: ipywidgets sliders, dropdowns and checkboxes, one per parameter.

It renders once with the defaults when displayed (so a headless run executes it),
recomputes only when a slider is *released* (``continuous_update=False``: no flood
of runs while dragging), shows a progress bar and status line while it works, and
exposes ``result`` and :meth:`Dashboard.update` so tests can drive it without a
browser. With ``run_button=True`` changes wait for a press of Run: for anything
that takes more than a few seconds.
"""

from __future__ import annotations

import decimal
import html
import inspect
import time
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as W
from traitlets import TraitError

from parlearn.core.checks import check_int

__all__ = ["Dashboard", "control", "OptionalRun", "Predict"]


def control(spec: Any, name: str) -> W.ValueWidget:
    """Turn a short spec into a widget (a widget is returned unchanged).

    * ``(lo, hi, step, value)`` of ints -> ``IntSlider``; with a float -> ``FloatSlider``
      whose readout shows as many digits as the step and bounds need (0.05 -> 2 digits)
    * ``[a, b, c]`` (a list) -> ``Dropdown`` whose first item is the default
    * ``True``/``False`` -> ``Checkbox``
    """
    if isinstance(spec, W.ValueWidget):
        widget = spec
    elif isinstance(spec, bool):
        widget = W.Checkbox(value=spec, description=name)
    elif isinstance(spec, list):
        if not spec:
            raise ValueError(f"control {name!r}: a dropdown needs at least one option")
        widget = W.Dropdown(options=spec, value=spec[0], description=name)
    elif isinstance(spec, tuple) and len(spec) == 4:
        lo, hi, step, value = spec
        if not lo <= value <= hi:
            raise ValueError(f"control {name!r}: default {value} outside [{lo}, {hi}]")
        if all(isinstance(v, int) for v in spec):
            widget = W.IntSlider(min=lo, max=hi, step=step, value=value, description=name)
        else:
            widget = W.FloatSlider(min=lo, max=hi, step=step, value=value, description=name,
                                   readout_format=f".{_decimals(spec)}f")
    else:
        raise TypeError(
            f"control {name!r}: expected a widget, (lo, hi, step, value), a list or a bool; "
            f"got {spec!r}"
        )
    if hasattr(widget, "continuous_update"):
        widget.continuous_update = False
    widget.style = {"description_width": "initial"}
    return widget


def _decimals(values) -> int:
    """Digits after the point needed to show every one of ``values`` exactly (at least 1)."""
    exps = [decimal.Decimal(repr(float(v))).normalize().as_tuple().exponent for v in values]
    return max(1, *(-e for e in exps if isinstance(e, int)))


class Dashboard:
    """Sliders that re-run ``compute`` and redraw ``plot``.

    Parameters
    ----------
    compute:
        ``compute(**params) -> result``. If it takes a ``progress`` argument it is
        given a callback ``progress(fraction, text="")`` that moves the progress bar.
    plot:
        ``plot(result, ax)``; ``ax`` is an array of axes when ``ncols > 1``.
    controls:
        ``{param_name: widget or spec}`` (see :func:`control`).
    run_button:
        Recompute only when Run is pressed (for long computations).
    """

    def __init__(
        self,
        compute: Callable[..., Any],
        plot: Callable[[Any, Any], None],
        controls: Mapping[str, Any],
        *,
        run_button: bool = False,
        ncols: int = 1,
        figsize: tuple[float, float] = (7.0, 4.0),
        title: str = "",
    ) -> None:
        if not callable(compute) or not callable(plot):
            raise TypeError("compute and plot must be callables")
        check_int("ncols", ncols, lo=1)
        self.compute_fn = compute
        self.plot_fn = plot
        self.controls = {name: control(spec, name) for name, spec in controls.items()}
        self._takes_progress = "progress" in inspect.signature(compute).parameters
        self.ncols, self.figsize, self.title = ncols, figsize, title
        self.progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout={"width": "240px"})
        self.status = W.HTML()
        self.out = W.Output()
        self.run = W.Button(description="Run", button_style="primary") if run_button else None
        self.result: Any = None
        self.error: Exception | None = None
        self.figure = None
        self.elapsed_s: float | None = None
        self._displayed = False
        for widget in self.controls.values():
            widget.observe(self._on_change, names="value")
        if self.run is not None:
            self.run.on_click(lambda _: self._recompute_safely())
        self._recompute()

    @property
    def params(self) -> dict[str, Any]:
        """Current value of every control."""
        return {name: w.value for name, w in self.controls.items()}

    def update(self, **params: Any) -> Any:
        """Set controls to ``params``, recompute, redraw, and return the new result.

        Raises like ``compute`` does (the browser path shows the error instead).
        """
        unknown = set(params) - set(self.controls)
        if unknown:
            raise ValueError(f"unknown parameter(s) {sorted(unknown)}; have {list(self.controls)}")
        for name, value in params.items():
            widget = self.controls[name]
            widget.unobserve(self._on_change, names="value")
            try:
                widget.value = value
            except TraitError as err:
                msg = f"{name}={value!r} is outside what its control allows: {err}"
                raise ValueError(msg) from err
            finally:
                widget.observe(self._on_change, names="value")
            if widget.value != value:
                raise ValueError(f"{name}={value!r} is outside what its control allows")
        return self._recompute()

    def _set_progress(self, fraction: float, text: str = "") -> None:
        self.progress.value = min(max(float(fraction), 0.0), 1.0)
        if text:
            self.status.value = f"<i>{text}</i>"

    def _recompute(self) -> Any:
        self.progress.bar_style = ""
        self._set_progress(0.0, "computing...")
        kwargs = dict(self.params)
        if self._takes_progress:
            kwargs["progress"] = self._set_progress
        start = time.perf_counter()
        self.result = self.compute_fn(**kwargs)
        self.elapsed_s = time.perf_counter() - start
        self._set_progress(1.0)
        self.progress.bar_style = "success"
        self.status.value = f"updated in {self.elapsed_s:.2f} s"
        self._render()
        return self.result

    def _recompute_safely(self) -> None:
        # A browser callback has nowhere to raise to: every error of compute or plot is
        # shown in the status line (with its type), and kept in ``self.error`` for tests.
        self.error = None
        try:
            self._recompute()
        except Exception as err:  # noqa: BLE001 - shown to the user, not swallowed
            self.error = err
            self.progress.bar_style = "danger"
            self.status.value = (f"<b>error ({type(err).__name__}):</b> "
                                 f"{html.escape(str(err))}")

    def _on_change(self, _change: dict) -> None:
        if self.run is not None:
            self.status.value = "parameters changed: press <b>Run</b>"
            return
        self._recompute_safely()

    def _render(self) -> None:
        import matplotlib.pyplot as plt
        from IPython import get_ipython

        fig, axes = plt.subplots(1, self.ncols, figsize=self.figsize, squeeze=True)
        self.plot_fn(self.result, axes)
        if self.title:
            fig.suptitle(self.title)
        fig.tight_layout()
        self.figure = fig
        plt.close(fig)
        shell = get_ipython()
        if self._displayed and shell is not None:
            # Set the Output widget's outputs directly instead of `with self.out: display()`:
            # capturing a display into an Output widget while the cell that shows it runs
            # races with a headless client's wait for the cell's reply (jupyter/nbclient#312):
            # lesson 30 sat idle for the whole cell timeout in 3 of 5 nbconvert runs.
            data, metadata = shell.display_formatter.format(fig)
            self.out.outputs = ({"output_type": "display_data", "data": data,
                                 "metadata": metadata},)

    def widget(self) -> W.Widget:
        """The whole dashboard as one ipywidgets box."""
        bar = [self.run] if self.run is not None else []
        box = W.VBox(
            [
                W.HBox(list(self.controls.values()), layout={"flex_flow": "row wrap"}),
                W.HBox([*bar, self.progress, self.status]),
                self.out,
            ]
        )
        # Stable hooks for the browser test (tests/browser): it finds every dashboard,
        # moves a control and waits for the figure in the output to change.
        box.add_class("parlearn-dashboard")
        self.status.add_class("parlearn-status")
        self.out.add_class("parlearn-figure")
        return box

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
        self._displayed = True
        self._render()


class OptionalRun:
    """A button for an optional, slow step of a lesson (a comparison with a real package):
    pressing it calls ``run()`` and shows the text it returns, or its error, below it.

    ``now=True`` presses it at once, errors raising (``settings.fast()`` in a lesson: the
    tests run exactly what the button runs, and fail when it fails); otherwise Run All
    skips the step until the reader asks for it. ``text`` holds the last result. If ``run``
    takes a ``progress`` argument it is given ``progress(fraction, text="")``, which moves a
    progress bar beside the button (as in :class:`Dashboard`).
    """

    def __init__(self, description: str, run: Callable[..., str], *, now: bool = False) -> None:
        if not callable(run):
            raise TypeError(f"run must be callable, got {type(run).__name__}")
        if not isinstance(now, bool):
            raise TypeError(f"now must be a bool, got {type(now).__name__}")
        self.run_fn = run
        self.button = W.Button(description=description, button_style="info",
                               layout={"width": "auto"})
        self.status = W.HTML("<i>not run: press the button</i>")
        self._takes_progress = "progress" in inspect.signature(run).parameters
        self.progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout={"width": "240px"})
        self.text: str | None = None
        self.error: Exception | None = None
        self.button.on_click(lambda _: self._press_safely())
        if now:
            self._press()

    def _press(self) -> str:
        self.status.value = "<i>running...</i>"
        self.progress.value = 0.0
        start = time.perf_counter()
        self.text = str(self.run_fn(progress=self._set_progress) if self._takes_progress
                        else self.run_fn())
        self.progress.value = 1.0
        self.status.value = (f"<pre>{html.escape(self.text)}</pre>"
                             f"<i>done in {time.perf_counter() - start:.1f} s</i>")
        return self.text

    def _set_progress(self, fraction: float, text: str = "") -> None:
        self.progress.value = min(max(float(fraction), 0.0), 1.0)
        if text:
            self.status.value = f"<i>{html.escape(text)}</i>"

    def _press_safely(self) -> None:
        # A browser callback has nowhere to raise to: the error goes to the status line.
        self.error = None
        try:
            self._press()
        except Exception as err:  # noqa: BLE001 - shown to the user, not swallowed
            self.error = err
            self.status.value = f"<b>error ({type(err).__name__}):</b> {html.escape(str(err))}"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(W.VBox([W.HBox([self.button, self.progress]), self.status]))


class Predict:
    """Predict, then run: the learner commits an answer *before* the cell that measures it,
    and :meth:`reveal` sets the guess beside what was measured and modeled, with a reason.

    ``Predict("the bubble fraction of 1F1B at P=4, M=8")`` shows the question and a box to
    type a number into (or, with ``choices=``, a menu); ``value=`` fills it from code.
    After the run, ``guess.reveal(measured=..., modeled=..., why=...)`` (or ``answer=``
    for a choice) prints, e.g., "you guessed 0.2: measured 0.41 (you were 2.1x too low);
    modeled (P-1)/(M+P-1) = 0.27" and returns that text. Without a guess it still shows
    the result, so Run All works headless.
    """

    def __init__(self, question: str, *, unit: str = "", value: Any = None,
                 choices: list | tuple | None = None) -> None:
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question must be a non-empty str, got {question!r}")
        if not isinstance(unit, str):
            raise TypeError(f"unit must be a str, got {type(unit).__name__}")
        self.question, self.unit = question, unit
        self.choices = None if choices is None else list(choices)
        if self.choices is not None:
            if len(self.choices) < 2:
                raise ValueError(f"choices must offer at least two answers, got {choices!r}")
            if value is not None and value not in self.choices:
                raise ValueError(f"value must be one of choices {self.choices}, got {value!r}")
            self.box = W.Dropdown(options=[("(choose)", None)] + [(str(c), c) for c in
                                                                  self.choices],
                                  value=value, layout={"width": "auto"})
        else:
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, int | float)):
                raise TypeError(f"value must be a number or None, got {value!r}")
            self.box = W.Text(value="" if value is None else repr(value),
                              placeholder="your number", layout={"width": "160px"})
        self.verdict = W.HTML("")

    @property
    def value(self) -> Any:
        """The committed answer: a float (or a choice), None when nothing was entered."""
        if self.choices is not None:
            return self.box.value
        text = self.box.value.strip().replace(",", "")
        if not text:
            return None
        try:
            return float(text)
        except ValueError:
            return None

    def reveal(self, *, measured: Any = None, modeled: Any = None, answer: Any = None,
               why: str = "") -> str:
        """Print (and return) the guess beside ``measured``, ``modeled`` (each a number, or
        ``(number, "how")`` to say on what or by which formula) or the right ``answer``."""
        if measured is None and modeled is None and answer is None:
            raise ValueError("reveal needs measured, modeled or answer")
        guess = self.value
        parts = [f"Q: {self.question}",
                 "you guessed " + ("nothing (type an answer above and run again)"
                                   if guess is None else f"{_fmt(guess)}{self.unit}")]
        if answer is not None:
            right = guess is not None and guess == answer
            parts.append(f"answer: {answer}" + ("" if guess is None else
                                                (" (right)" if right else " (not this time)")))
        for name, item in (("measured", measured), ("modeled", modeled)):
            if item is None:
                continue
            number, how = item if isinstance(item, tuple) else (item, "")
            line = f"{name}{' ' + how if how else ''}: {_fmt(number)}{self.unit}"
            if isinstance(guess, float) and isinstance(number, int | float):
                line += _off_by(guess, float(number))
            parts.append(line)
        if why:
            parts.append(f"why: {why}")
        text = _Shown("\n".join(parts))
        self.verdict.value = f"<pre>{html.escape(text)}</pre>"
        print(text)
        return text

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(W.VBox([W.HTML(f"<b>Predict first:</b> {html.escape(self.question)}"
                               + (f" ({html.escape(self.unit.strip())})" if self.unit.strip()
                                  else "")), self.box]))


class _Shown(str):
    """The verdict's text, already printed: as a cell's last value it shows nothing more."""

    def _ipython_display_(self) -> None:
        pass


def _fmt(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _off_by(guess: float, truth: float) -> str:
    if guess == truth:
        return " (exactly your guess)"
    if guess > 0 and truth > 0:
        ratio = max(guess, truth) / min(guess, truth)
        if ratio < 1.05:
            return " (within 5% of your guess)"
        return f" (you were {ratio:.1f}x too {'high' if guess > truth else 'low'})"
    return f" (you were off by {abs(guess - truth):.3g})"
