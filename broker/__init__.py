"""rankboard broker: PULL ingest, pure per-run sinks, PUB feed and snapshot."""
