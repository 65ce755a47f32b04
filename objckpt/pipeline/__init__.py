"""The async layer: stage to host memory, upload from worker processes, commit later.

``checkpointer`` drives a save; ``stage`` owns staging memory, ``workers`` the
upload processes (with ``lifeline`` tying them to the trainer), ``deferred`` is the
DCP writer that queues instead of uploading, ``finalize`` gathers ranks through the
c10d store, ``plan_cache`` reuses plans, ``queue`` is the seeds' request queue and
``handle`` what the caller holds. Builds on the DCP plugin layer.
"""
