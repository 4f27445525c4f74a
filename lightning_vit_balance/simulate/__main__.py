"""``python -m lightning_vit_balance.simulate``: see :mod:`lightning_vit_balance.simulate.cli`."""

from lightning_vit_balance.simulate.cli import main

__all__: list[str] = []

raise SystemExit(main())
