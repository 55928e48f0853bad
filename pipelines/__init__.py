"""Ray orchestration around :mod:`laplace_core` and the ``infoform`` command line.

Importing this package is cheap and does not start or import Ray; submodules that need
Ray import it themselves.

Its packages are layered (docs/design.md, "Layers"): a package imports only from its own
layer's members' lower layers, never from a layer above it, so the package-level import
graph has no circle (``tests/test_structure.py`` checks both).
"""

#: The layers, lowest first: each entry's packages (or top-level modules) may import the
#: entries before it and nothing after it; packages in one entry do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "console", "malloc"),
    ("storage",),
    ("config",),
    ("ingest",),
    ("distributed",),
    ("passes", "evaluation"),
    ("report",),
    ("serve",),
    ("cli",),
    ("__main__",),
)
