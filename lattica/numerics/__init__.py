"""Pure tensor numerics shared by training and the data plane.

``codecs`` (dense encodings and their sizes), ``sparse`` (the sparse 2-bit payloads of SparseLoCo
and DeMo), ``screen`` (how contributions are screened and combined) and ``partner_screen`` (what
a replica refuses of its group partners). Nothing here does I/O or
imports the network: ``lattica.train`` may use it without pulling in the data plane.
"""
