"""Running collectives: the ``Communicator`` (the API and its argument checks), the executor
that runs a schedule over a transport, point-to-point messages, and in-process groups."""
