"""Optimizer steps (PROTOCOL.md 2.4): closing them across ranks and keeping them, columnar.

``closer`` decides *when* a step closes (watermark, grace, force-close); ``columns`` does
*how*: pending points as arrays, reduced per step into a ``ClosedSteps`` batch, with the
exact float arithmetic in ``reduce``; ``store`` keeps closed steps for queries and is shared
with the web (it imports only numpy and the standard library, as this file does).
"""
