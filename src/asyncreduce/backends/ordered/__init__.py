"""Backends over engines that need one order of collectives on every rank (MPI, torch.distributed).

``agreement.py`` (sans-IO) makes the ranks agree which posted operations are ready everywhere
and in which order; ``channel.py`` carries its messages; ``engine.py`` is the one thread that
owns the engine, with its engine calls (``calls.py``, fused: ``fusion.py``), its stall
warnings (``stalls.py``), its failure path (``failure.py``) and its goodbye (``closing.py``) in
modules of their own (its clocks are the native engine's: ``protocol/liveness.py``);
``mpi.py`` and ``torchdist.py`` turn agreed operations into engine calls; bootstrap/ordered.py
builds a communicator over them (``ar.init(backend=...)``). docs/engines.md explains the
protocol and measures it.
"""
