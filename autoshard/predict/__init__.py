"""Predictions of a candidate without running it: activation profiles on fake tensors
(:mod:`.activations`), the analytic model (:mod:`.analytic`), the simulation of real FSDP code on
fake tensors (:mod:`.simulate`), and its speed: the FLOP profile on fake tensors (:mod:`.flops`)
and the step-time model (:mod:`.speed`)."""
