"""Watching real runs: wrappers that record what every engine, link and board post did.

``steps`` keeps each executed step in a list (tests and teaching tools); ``timeline`` records
a rank's ops, steps and messages into a bounded ring and writes Chrome trace-event JSON
(``RINGCOMM_TRACE``, ``ringcomm.init(trace=)``, ``comm.tracing(DIR)``); ``merge`` puts every
rank's file on one clock and ``plot`` draws it. Each is a ``Wrapper`` installed through the
one hook of ``ringcomm.engines.wrapping``, so a watched run takes the same paths as any other.
"""
