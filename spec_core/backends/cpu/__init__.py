"""The CPU backend's parts: the compiled kernels (:mod:`.cpu_kernels`, C sources in ``kernels/``), the weight
formats they multiply (:mod:`.quant`, :mod:`.w8a8`, :mod:`.kquant`) and row padding (:mod:`.row_padding`).

The runner switches them on for a CPU device; nothing here imports the CUDA-graph module, nor it anything here
(``tests/test_backends.py``).
"""
