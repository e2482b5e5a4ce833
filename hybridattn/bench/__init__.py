"""Benchmarks: programs beside the library, ours and an independent anchor side by side.

``python -m hybridattn.bench WHAT ...`` (:mod:`hybridattn.bench.cli` says what each measures):
``kda`` (:mod:`~hybridattn.bench.kda`), ``serve`` (:mod:`~hybridattn.bench.serve`, its
compile-time rows in :mod:`~hybridattn.bench.compile_time`, ``--mesh`` in
:mod:`~hybridattn.bench.mesh`), ``prefix`` (:mod:`~hybridattn.bench.prefix`), ``longctx``
(:mod:`~hybridattn.bench.longctx`) and ``mla`` (:mod:`~hybridattn.bench.mla`). The other
implementations and the bandwidth, compute and products bounds are in
:mod:`~hybridattn.bench.anchors`, the plots in :mod:`~hybridattn.bench.plots`, shared timing
in :mod:`~hybridattn.bench.common`.

Nothing in the library imports this package.
"""
