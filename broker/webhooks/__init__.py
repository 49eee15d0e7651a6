"""Alert webhooks (PROTOCOL.md 3.1): ``notifier`` (which alerts to POST, when, in a thread)
and ``post`` (one POST with a deadline for the whole attempt). Nothing is re-exported here.
"""
