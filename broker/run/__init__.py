"""One run's pure state (sans-I/O, README.md here): the sink and what it is made of.

``sink`` (:class:`~broker.run.sink.RunSink`, ``apply(frame, now) -> [Event]``) and its parts:
``epochs`` with ``aggregate``, ``collectivelast``,
``rankstate``, ``topology``, ``metadata``, ``alerts``, ``gpualerts``, ``failure``,
``attempts``, ``events`` (what a sink says) and ``steps`` (optimizer steps, a folder of its
own). The I/O around it (server, ingest, router, runs, journal) imports this, never the
other way. Nothing is re-exported here, so importing one part loads only what it needs.
"""
