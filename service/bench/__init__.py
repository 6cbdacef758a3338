"""Every ``shoal bench`` benchmark, measured on the machine at hand; the CLI
(``service.cli.bench``) only parses their options and prints their results.

The engines: ``report`` is pure (sizes, the ideal, efficiency, the JSON shapes);
``pipeline`` measures single-process PyTorch, Shoal's engine and framework overhead;
``peer`` runs ``torch.distributed.pipelining`` on the same model; ``step`` one job's steps
through the engine, with and without in-memory copies, against a plain PyTorch loop on the
same device (``step_settings``: its sizes and JSON shape, pure; ``hardware``: the device it
ran on); ``transport`` measures Ray object refs against Compiled Graphs and torch tensors
against numpy arrays; ``elastic`` the elastic runtime on a local multi-node cluster;
``sharp`` SHARP against training models one after another, and ``simulation`` SHARP's
orderings on modelled clusters.

The control plane: ``api`` load-tests the REST API, ``dashboard`` times the jobs page in a
real browser, both on scratch databases ``data`` seeds.
"""
