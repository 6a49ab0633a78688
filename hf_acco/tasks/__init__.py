"""The recipes' tasks: data and metrics the recipes and their tests share (``alpaca``: an instruction set generated
with answers a program checks; ``lambada``: LAMBADA's last-word accuracy; ``metrics/``: the ``evaluate`` modules,
loaded from their path; ``cli``: the recipes' defaults in ``--help``, the schedule from ``--method``). Not part of
the training library: nothing in engine/, comm/ or integrations/ imports it."""
