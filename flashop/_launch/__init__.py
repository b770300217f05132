"""The launchers (internal): the value types of one call, the score arguments, the tile
table, the gate's host-side parts, and the launches of the kernels in ``flashop.kernels``
(allocation, grids, the choice of kernel). Imports only ``flashop.config`` and the kernels."""
