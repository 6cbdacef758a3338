"""The pipeline engine: one job's stages on its devices, exact through relayout and loss.

``runner`` drives a job (its ``Trainer``, started by ``job_start``, and the ``JobRunner``
actor); ``group`` starts and calls its stage workers (``stage_worker``, each holding a
``stage`` built from the ``stage_types``' setup, with its ``micro_batches`` in flight kept
for their backwards); a step is one call per worker (``step_driver``) running the stage's
``step_program`` over ``transport`` links to its neighbours, replicas all-reducing over
``collective``; ``rebalance`` re-cuts and relays out, ``recovery`` restores a lost stage
from its buddy's in-memory ``copier`` copy or a checkpoint (``checkpoint_writer`` writes
them off the step's path); ``clipping`` and ``timing`` serve the stage's step.
"""
