"""Dispatch: claimed jobs -> Celery protocol-2 messages.

:class:`~celery_sched.dispatch.kombu.KombuDispatcher` publishes through Kombu;
:class:`~celery_sched.dispatch.memory.MemoryDispatcher` records messages for
unit tests. Both build the message headers with :mod:`celery_sched.protocol`,
so a fake and the real dispatcher agree on what a worker sees.

The body of every job is stored pre-serialized (``[args, kwargs, embed]`` in
the app's task serializer); dispatch never decodes or re-encodes it.
"""
