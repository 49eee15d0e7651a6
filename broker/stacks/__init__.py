"""Stack dumps (PROTOCOL.md 2.5): kept per run, sent to the feed, grouped across ranks.

``store`` keeps each rank's latest dump per reason within a byte budget; ``feed`` coalesces
new dumps into ``stacks`` events; ``groups`` reads a hang across ranks (shared with the web).
"""
