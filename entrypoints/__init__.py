"""The entry points, on top of every layer: the ``disagg-serve`` CLI, ``up`` (the whole system on one machine)
and the front-end supervisor (``--api-workers N``). They may import everything; nothing imports them."""
