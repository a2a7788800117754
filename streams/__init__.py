"""streams — FlexPipe's stream processors: telemetry in, explained gear decisions out.

Pure folds (:mod:`streams.state`, :mod:`streams.load`, :mod:`streams.windows`), snapshot building
(:mod:`streams.snapshot`) and the decision step (:mod:`streams.step`) take time as an input and do
no I/O; the Faust app (:mod:`streams.app`) only decodes, routes, writes tables and sends.
"""
