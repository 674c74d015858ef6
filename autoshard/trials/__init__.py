"""Short real FSDP runs: the worker (rank side, :mod:`.worker`), the group that drives workers
(driver side, :mod:`.group`), and the typed messages between them (:mod:`.protocol`)."""
