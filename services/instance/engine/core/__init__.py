"""The engine core shared by native, sim and fake: block pool, requests,
scheduler and the step loop (which delegates the forward pass to an executor)."""
