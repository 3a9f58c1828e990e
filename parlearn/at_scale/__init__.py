"""Part 5, running it for real: where the time goes (MFU you can trust, :mod:`.mfu`), and
when it breaks (the classic hangs, each diagnosed by the flight recorder, :mod:`.hangs`).
``from parlearn import mfu, hangs``."""

__all__: list[str] = []
