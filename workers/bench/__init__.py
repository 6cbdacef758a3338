"""Benchmarks of Shoal's engines and their transport, measured on the machine at hand.

``settings``/``report`` are pure (sizes, the ideal, efficiency, the JSON shape);
``pipeline`` measures single-process PyTorch, Shoal's engine and framework overhead;
``peer`` runs ``torch.distributed.pipelining`` on the same model; ``step`` one job's steps
through the engine, with and without in-memory copies, against a plain PyTorch loop on the
same device (``step_settings``: its sizes and JSON shape, pure); ``transport`` measures
Ray object refs against Compiled Graphs and torch tensors against numpy arrays; ``elastic``
the elastic runtime on a local multi-node cluster; ``sharp`` SHARP against training models
one after another, and ``simulation`` SHARP's orderings on modelled clusters.
"""
