"""Ray orchestration around :mod:`laplace_core` and the ``infoform`` command line.

Importing this package is cheap and does not start or import Ray; submodules that need
Ray import it themselves.
"""
