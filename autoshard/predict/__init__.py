"""Predictions of a candidate without running it: activation profiles on fake tensors
(:mod:`.activations`), the analytic model (:mod:`.analytic`), the simulation of real FSDP code on
fake tensors (:mod:`.simulate`), and its speed: the FLOP profile on fake tensors (:mod:`.flops`)
and the step-time model (:mod:`.speed`)."""

# The planning dimensions whose speed and memory effects the predictors model (predict/recipe.py):
# the space proposes them by themselves only when named here (autoshard.plan.modelled_dimensions).
MODELLED_DIMENSIONS = frozenset({"compile", "float8"})
