"""The SHARP executor: many models trained at once by alternating their shards on the
devices (Hydra's shard alternator parallelism), exact through losses and drains.

``runner`` (``SharpTrainer``) queues shard tasks and keeps copies and checkpoints
(``checkpointing``), taking requests from other threads through its ``inbox``; each model's
state is a ``models.ModelRun``, placed and re-homed by ``placing`` over the devices'
``homes``; ``shard_pool`` runs each device's ``shard_host`` (a ShardWorker actor on Ray,
threads in-process), which holds shards in device memory or spilled to host memory
(``saved``; on a GPU through ``pinned`` buffers); ``sweep_executor`` is a sweep's long-lived
executor actor.
"""
