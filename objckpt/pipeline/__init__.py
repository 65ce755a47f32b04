"""The async layer: stage to host memory, upload from worker processes, commit later.

``checkpointer`` owns what lasts across saves (and runs ``objckpt.async_save``); one
save walks ``save_phases`` on the caller's thread (stage, agree, plan or replay,
queue) and ``commit_phase`` on a background thread (uploads, gather, commit).
``stage`` owns staging memory, its background copy included (with ``segment``,
``state_walk`` and ``host_copy``), ``workers`` the upload processes (with
``lifeline`` tying them to the trainer), ``deferred`` is the DCP writer that queues
instead of uploading, ``finalize`` exchanges results through the c10d store,
``plan_cache`` reuses plans, ``queue`` is the seeds' request queue (an adapter over
the checkpointer's saves) and ``handle`` what the caller holds. Builds on the DCP plugin layer.
"""
