"""The broker's journal: what each run's sink was fed, on disk, replayed at start.

``journal`` (the :class:`~broker.journal.journal.Journal` the server calls), ``codec`` (the
file format), ``writer`` (open files and positioned writes), ``datadir`` (lock, version,
files moved aside), ``noops`` (frames left out because they change nothing), ``stepblocks``
(closed steps as STEPS entries) and ``replay`` (a run rebuilt from its entries).
Nothing is re-exported here, so importing one part loads only what that part needs.
"""
