"""Part 5, running it for real: where the time goes (MFU you can trust, :mod:`.mfu`).
``from parlearn import mfu``."""

__all__: list[str] = []
