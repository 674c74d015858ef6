"""Short real FSDP runs: the worker (rank side, :mod:`.worker`), the group that drives workers
(driver side, :mod:`.group`), the typed messages between them (:mod:`.protocol`), and what keeps
a group from outliving its driver (:mod:`.lifeline`)."""
