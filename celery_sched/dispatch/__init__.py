"""Dispatch: claimed jobs -> Celery protocol-2 messages.

:class:`~celery_sched.dispatch.kombu.KombuDispatcher` publishes through the
app's broker; :class:`~celery_sched.dispatch.memory.MemoryDispatcher` records
messages for unit tests. Both build the message headers with
:mod:`celery_sched.protocol`, so a fake and the real dispatcher agree on what
a worker sees.

The Kombu dispatcher's parts, by file: ``kombu.py`` (preparing messages,
retries, choosing a path per connection), ``routing.py``, ``connection.py``
(the connection and the queues declared on it), ``outgoing.py`` (the
prepared message and the books of a chunk), ``failures.py`` (what is
retried, what fails one destination), one module per publish path
(``path_redis.py``, ``path_amqp.py`` with ``amqp_wire.py``,
``path_kombu.py``), ``fast_path.py`` (whether a connection may use a fast
path) and ``sent_events.py`` (task-sent events written by the fast paths).

The body of every job is stored pre-serialized (``[args, kwargs, embed]`` in
the app's task serializer); dispatch never decodes or re-encodes it.
"""
